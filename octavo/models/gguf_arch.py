"""GGUF architectures Octavo reads (llama, and with it Mistral; qwen2, qwen3, gemma2, gemma3, phi3;
the mixtures of experts qwen2moe, qwen3moe and gpt-oss; lfm2, attention beside short convolutions): a file's
metadata as a Hugging Face config dict, its tensor names as checkpoint names, and its tensors in
the checkpoint's conventions (llama.cpp's converter interleaves Llama q/k rows and stores Gemma's
norm weights as 1 + w; both are undone here, so every loader path sees one convention).

llama.cpp writes Mistral checkpoints under the `llama` architecture, so "mistral" GGUFs are llama
files. No weights are touched here beyond reshaping rows; see loader.py for what is loaded how.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from octavo.models.gguf_file import ArrayValue, GGUFFormatError, GGUFHeader, read_header

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe", "gpt-oss", "lfm2")
MOE = ("qwen2moe", "qwen3moe", "gpt-oss")

_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "lfm2": ("Lfm2ForCausalLM", "lfm2"),
}

_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "token_embd_norm": "model.norm",  # LFM2's final norm (llama.cpp keeps the checkpoint's odd name)
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, every expert's weights stacked in one tensor each (split per
    # expert at load: loader.per_expert), the shared expert and its gate (Qwen2-MoE)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 2 and 3 have four norms per layer: llama.cpp's `ffn_norm` is the one before the feed-forward.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps q|k|v in one tensor and gate|up in `ffn_up` (gate rows first), as its checkpoints do
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# gpt-oss: `post_attention_norm` is the norm before the feed-forward (llama.cpp's ATTN_POST_NORM),
# one sink logit per query head (the checkpoint's `sinks`, a parameter without a `.weight`)
_GPT_OSS_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
# LFM2: the operator norm is `attn_norm`; a short-convolution layer's three tensors go straight to
# models/lfm2.py's names (its kernel [hidden, kernel] as the file holds it)
_LFM2_LAYER_NAMES = {**_LAYER_NAMES, "shortconv.conv": "conv", "shortconv.in_proj": "conv.in_proj",
                     "shortconv.out_proj": "conv.out_proj"}
# Vocabulary entries that end a chat turn: each one present becomes a stop id.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


# Gemma's turn format, for GGUF files that carry no chat template (the Gemma 3 270M file on PyPI):
# no system role, so a system message is put before the first user turn's text.
GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set prefix = '' -%}{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)


def default_chat_template(arch: str) -> str | None:
    """The chat template to write when the file has none (None: leave it without)."""
    return GEMMA_CHAT_TEMPLATE if arch in ("gemma2", "gemma3") else None


class UnsupportedGGUFError(GGUFFormatError):
    pass


def architecture(header: GGUFHeader) -> str:
    """The file's `general.architecture`; UnsupportedGGUFError names the supported ones."""
    arch = header.get("general.architecture")
    if arch not in SUPPORTED:
        raise UnsupportedGGUFError(
            f"{header.path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)} "
            "(Mistral models are written as llama)"
        )
    return arch


# Tensors that are configuration, not weights: read into the config by `hf_config`, never loaded.
# rope_freqs: Llama 3.1+ RoPE scaling as one divisor per rotary pair (llama.cpp's converter writes
# it from the checkpoint's rope_scaling and no rope-scaling metadata beside it).
# rope_factors_long / _short: LongRoPE's two factor sets (Phi-3 128k, Phi-3.5, Phi-4-mini), the same.
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def rope_freq_factors(header: GGUFHeader, name: str = "rope_freqs.weight") -> list[float] | None:
    """The values of the file's per-pair RoPE factor tensor `name` (F32, one per rotary pair), or
    None when it has none; GGUFFormatError when they are not positive finite numbers."""
    info = header.tensors.get(name)
    if info is None:
        return None
    if info.type_name != "F32":
        raise GGUFFormatError(f"{header.path.name}: tensor {name} is {info.type_name}; llama.cpp writes it F32")
    with open(header.path, "rb") as fh:
        fh.seek(info.offset)
        raw = fh.read(info.num_bytes)
    values = list(struct.unpack(f"<{info.num_elements}f", raw))
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise GGUFFormatError(f"{header.path.name}: tensor {name} holds a value that is not a positive "
                              "finite number (each divides a rotary frequency)")
    return values


def hf_name(gguf_name: str, arch: str) -> str:
    """A GGUF tensor name (`blk.3.attn_q.weight`) -> the checkpoint's (`model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    names = {"gemma2": _GEMMA3_LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES,
             "gpt-oss": _GPT_OSS_LAYER_NAMES, "lfm2": _LFM2_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    parts = stem.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in names:
        raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")
    if parts[2] == "attn_sinks":
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"


def _unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row interleaving llama.cpp applies to Llama q/k weights: GGUF keeps each head's
    rotary pairs interleaved (x0, x_{d/2}, x1, ...), checkpoints keep the halves apart
    (rotate-half). Rows go [head, pair, 2] -> [head, 2, pair]; whole rows move, so rows of
    quantized blocks are handled alike."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_checkpoint(name: str, rows: np.ndarray, hf_config: dict[str, Any], is_float: bool) -> np.ndarray:
    """A tensor (float rows, or rows of blocks) in the checkpoint's convention, given its
    checkpoint `name`: Llama q/k rows un-interleaved, Gemma norm weights back to w (GGUF: 1 + w)."""
    model_type = hf_config["model_type"]
    if model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rope(rows, hf_config["num_attention_heads"])
    if model_type == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rope(rows, hf_config["num_key_value_heads"])
    if model_type in ("gemma2", "gemma3_text") and is_float and name.endswith("norm.weight"):
        return rows - np.float32(1.0)
    if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps [hidden]; the checkpoint [1, hidden]
        return rows.reshape(1, -1)
    return rows


def _stop_ids(header: GGUFHeader, tokens: list[str]) -> list[int]:
    """The file's eos id and the id of every end-of-turn token in its vocabulary."""
    ids = []
    eos = header.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        ids.append(int(eos))
    wanted = set(END_OF_TURN_TOKENS)
    ids.extend(i for i, t in enumerate(tokens) if t in wanted and i not in ids)
    return ids


def hf_config(header: GGUFHeader, hp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json a checkpoint of this file's model would have (transformers loads it), after
    checking the file's hyperparameters, tokenizer arrays and tensors (`check_model`; `hp`: what
    it returned already, so a caller that checked does not check twice): GGUFFormatError names the
    key or tensor that is wrong."""
    hp = hp or check_model(header)
    arch = hp["arch"]
    get = lambda key, default=None: default if header.get(f"{arch}.{key}") is None else header.get(f"{arch}.{key}")  # noqa: E731
    hf_arch, model_type = _HF_ARCH[arch]
    stop_ids = _stop_ids(header, header.strings("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": hp["vocab"],
        "hidden_size": hp["hidden"],
        "intermediate_size": hp["ff"],
        "num_hidden_layers": hp["layers"],
        "num_attention_heads": hp["heads"],
        "num_key_value_heads": hp["kv_heads"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "bos_token_id": header.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
        "torch_dtype": "float32",
    }
    if arch in ("qwen2", "qwen2moe") or "blk.0.attn_q.bias" in header.tensors:
        config["attention_bias"] = True  # Qwen2: q/k/v; Llama: q/k/v and the output projection
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    if arch == "gemma2":
        config.update(_gemma2_config(get, config))
    if arch == "phi3" and get("attention.sliding_window"):  # (0: none, as the converter writes for Phi-4)
        config["sliding_window"] = int(get("attention.sliding_window"))  # every layer (llama.cpp, transformers)
    if arch == "lfm2":
        config.update(_lfm2_config(header, hp))
    if arch == "gpt-oss":
        config.update(_gpt_oss_config(get, hp))
    elif arch in MOE:
        config.update(_moe_config(hp, get("expert_weights_norm", arch == "qwen3moe")))
    scaling = _rope_scaling(header, arch, config)
    if scaling is not None:
        config["rope_parameters"] = scaling
    factors = rope_freq_factors(header)
    if factors is not None:
        config["rope_freq_factors"] = factors  # models.registry reads it into RopeConfig.freq_factors
    if hp["rot"] < hp["head_dim"]:  # partial rotary (Phi-4-mini): rope.dimension_count of each head
        config["partial_rotary_factor"] = hp["rot"] / hp["head_dim"]
    longrope = _longrope_config(header, arch, config)
    if longrope is not None:
        config["rope_parameters"] = longrope
    return config


def _longrope_config(header: GGUFHeader, arch: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """LongRoPE from the file (llama.cpp's Phi-3 converter): the factor tensors, the original context
    (`rope.scaling.original_context_length`, required beside them) and the attention factor it
    computed (`rope.scaling.attn_factor`); None without the tensors."""
    long, short = (rope_freq_factors(header, f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is None and short is None:
        return None
    if long is None or short is None:
        raise GGUFFormatError(f"{header.path.name}: LongRoPE needs both rope_factors_long and rope_factors_short")
    original = header.get(f"{arch}.rope.scaling.original_context_length")
    if isinstance(original, (bool, float, str, ArrayValue)) or original is None or original < 1:
        raise GGUFFormatError(f"{header.path.name}: LongRoPE needs {arch}.rope.scaling.original_context_length "
                              "(a positive integer)")
    params = {"rope_type": "longrope", "rope_theta": config["rope_theta"], "long_factor": long, "short_factor": short,
              "original_max_position_embeddings": int(original)}
    attn = header.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        if isinstance(attn, (bool, str, ArrayValue)) or not math.isfinite(attn) or attn <= 0:
            raise GGUFFormatError(f"{header.path.name}: {arch}.rope.scaling.attn_factor must be a positive number")
        params["attention_factor"] = float(attn)
    return params


# Hyperparameters a file must state (under `ARCH.`), and the range each is read in: a value
# outside it is refused by name (these bound every tensor shape and the memory that follows).
_REQUIRED_INTS = {
    "block_count": (1, 1024), "embedding_length": (1, 1 << 17), "feed_forward_length": (1, 1 << 20),
    "attention.head_count": (1, 1024),
}
_OPTIONAL_INTS = {
    "attention.head_count_kv": (1, 1024), "attention.key_length": (2, 4096), "attention.value_length": (2, 4096),
    "rope.dimension_count": (2, 4096), "context_length": (1, 1 << 24), "attention.sliding_window": (0, 1 << 24),
    "vocab_size": (1, 1 << 24), "expert_count": (1, 1 << 12), "expert_used_count": (1, 1 << 12),
    "expert_feed_forward_length": (1, 1 << 20), "expert_shared_feed_forward_length": (1, 1 << 20),
}
_POSITIVE_FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")
_FLOAT_TYPES = ("F32", "F16", "BF16")  # norms and biases: what the loader copies as dense values


def _int_field(header: GGUFHeader, key: str, bounds: tuple[int, int], required: bool) -> int | None:
    value = header.get(key)
    if value is None:
        if required:
            raise GGUFFormatError(f"{header.path.name}: metadata {key} is missing")
        return None
    if isinstance(value, (bool, float, str, ArrayValue)) or not isinstance(value, int):
        raise GGUFFormatError(f"{header.path.name}: metadata {key} must be an integer, got {type(value).__name__}")
    low, high = bounds
    if not low <= value <= high:
        raise GGUFFormatError(f"{header.path.name}: metadata {key} = {value} is outside [{low}, {high}]")
    return value


def check_model(header: GGUFHeader) -> dict[str, Any]:
    """The file's hyperparameters, checked: each in range and consistent with the others, the
    tokenizer's arrays of one length (the vocabulary) and types, its special ids inside it, and
    every tensor the architecture has present (the output head may be tied), with the shape and
    a type it can have; no other tensor. GGUFFormatError (one line) names what is wrong."""
    name = header.path.name
    arch = architecture(header)
    conv_layers = _lfm2_conv_layers(header) if arch == "lfm2" else None
    ints = {k: _int_field(header, f"{arch}.{k}", b, True) for k, b in _REQUIRED_INTS.items()}
    optional = {k: b for k, b in _OPTIONAL_INTS.items() if not (conv_layers is not None and k == "attention.head_count_kv")}
    ints |= {k: _int_field(header, f"{arch}.{k}", b, False) for k, b in optional.items()}
    if conv_layers is not None:  # LFM2: a KV head count per layer, 0 for a short convolution
        ints["attention.head_count_kv"] = max(header.numbers("lfm2.attention.head_count_kv"))
    for key in _POSITIVE_FLOATS:
        value = header.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, (bool, str, ArrayValue)) or not math.isfinite(value) or value <= 0):
            raise GGUFFormatError(f"{name}: metadata {arch}.{key} must be a positive finite number, got {value!r}")
    hidden, heads = ints["embedding_length"], ints["attention.head_count"]
    kv_heads = ints["attention.head_count_kv"] or heads
    if heads % kv_heads:
        raise GGUFFormatError(f"{name}: {heads} attention heads are not a multiple of {kv_heads} KV heads")
    # the head size is key_length, else hidden / heads; rope.dimension_count the values each head
    # rotates (fewer than the head: partial rotary, Phi-4-mini), as llama.cpp reads them
    head_dim = ints["attention.key_length"] or hidden // heads
    rot = ints["rope.dimension_count"] or head_dim
    if head_dim < 2 or head_dim % 2 or rot % 2 or rot > head_dim:
        raise GGUFFormatError(f"{name}: the head size {head_dim} and its rotary part {rot} must be even, the "
                              "second no larger")
    if ints["attention.value_length"] not in (None, head_dim):
        raise GGUFFormatError(f"{name}: value heads of {ints['attention.value_length']} differ from key heads of {head_dim}")
    if arch in ("gemma2", "gemma3", "gpt-oss") and not ints["attention.sliding_window"]:
        raise GGUFFormatError(f"{name}: metadata {arch}.attention.sliding_window is missing")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = header.get(f"{arch}.{key}")
        if value is not None and (isinstance(value, (bool, str, ArrayValue)) or not math.isfinite(value) or value <= 0):
            raise GGUFFormatError(f"{name}: metadata {arch}.{key} must be a positive finite number, got {value!r}")
    vocab = _check_tokenizer(header)
    if ints["vocab_size"] not in (None, vocab):
        raise GGUFFormatError(f"{name}: {arch}.vocab_size {ints['vocab_size']} differs from the {vocab} tokens")
    hp = {"arch": arch, "vocab": vocab, "hidden": hidden, "ff": ints["feed_forward_length"],
          "layers": ints["block_count"], "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rot": rot}
    if arch in MOE:
        hp |= _moe_hyperparameters(name, arch, ints)
    if conv_layers is not None:
        hp |= {"conv_layers": conv_layers,
               "conv_kernel": _int_field(header, "lfm2.shortconv.l_cache", (2, 64), True)}
    _check_tensors(header, expected_tensors(header, hp))
    return hp


def _check_tokenizer(header: GGUFHeader) -> int:
    """The vocabulary size: tokenizer.ggml.tokens' length, with scores and token types as long,
    merges strings, and the special ids inside the vocabulary."""
    name = header.path.name
    tokens = header.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, ArrayValue) or tokens.elem_type != 8 or tokens.count < 1:
        raise GGUFFormatError(f"{name}: tokenizer.ggml.tokens (the vocabulary, an array of strings) is missing or empty")
    if not isinstance(header.get("tokenizer.ggml.model"), str):
        raise GGUFFormatError(f"{name}: tokenizer.ggml.model (the tokenizer's kind) is missing")
    for key, elem_types in (("tokenizer.ggml.scores", (6,)), ("tokenizer.ggml.token_type", (4, 5))):
        value = header.get(key)
        if value is None:
            continue
        if not isinstance(value, ArrayValue) or value.elem_type not in elem_types or value.count != tokens.count:
            raise GGUFFormatError(f"{name}: {key} must be an array of {tokens.count} numbers (one per token)")
    merges = header.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, ArrayValue) or merges.elem_type != 8):
        raise GGUFFormatError(f"{name}: tokenizer.ggml.merges must be an array of strings")
    if merges is not None and merges.count:
        # a BPE merge "a b" joins two vocabulary entries into a third (what the tokenizers library
        # checks when it builds the tokenizer, after torch and transformers are loaded)
        vocab = set(header.strings("tokenizer.ggml.tokens"))
        for i, merge in enumerate(header.strings("tokenizer.ggml.merges")):
            left, sep, right = merge.partition(" ")
            if not sep or left not in vocab or right not in vocab or left + right not in vocab:
                raise GGUFFormatError(f"{name}: tokenizer.ggml.merges[{i}] = {merge[:40]!r} does not join two "
                                      "vocabulary entries into a third")
    for key in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        full = f"tokenizer.ggml.{key}_token_id"
        value = header.get(full)
        if value is not None and (isinstance(value, (bool, float, str, ArrayValue)) or not 0 <= value < tokens.count):
            raise GGUFFormatError(f"{name}: {full} = {value!r} is not a token id of the {tokens.count}-token vocabulary")
    return tokens.count


def expected_tensors(header: GGUFHeader, hp: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF tensor name -> (shape in GGUF order, required) for this architecture and shape."""
    hidden, ff, vocab, head_dim = hp["hidden"], hp["ff"], hp["vocab"], hp["head_dim"]
    q, kv = hp["heads"] * head_dim, hp["kv_heads"] * head_dim
    out: dict[str, tuple[tuple[int, ...], bool]] = {
        "token_embd.weight": ((hidden, vocab), True), "output_norm.weight": ((hidden,), True),
        "output.weight": ((hidden, vocab), False),
    }
    layer = {
        "attn_norm.weight": (hidden,), "attn_q.weight": (hidden, q), "attn_k.weight": (hidden, kv),
        "attn_v.weight": (hidden, kv), "attn_output.weight": (q, hidden), "ffn_gate.weight": (hidden, ff),
        "ffn_up.weight": (hidden, ff), "ffn_down.weight": (ff, hidden), "ffn_norm.weight": (hidden,),
    }
    arch = hp["arch"]
    if arch == "llama":  # Llama 3.1+: the RoPE scaling as per-pair factors (CONFIG_TENSORS)
        out["rope_freqs.weight"] = ((hp["rot"] // 2,), False)
    if arch == "phi3":  # LongRoPE's factor sets (CONFIG_TENSORS)
        out |= {f"rope_factors_{k}.weight": ((hp["rot"] // 2,), False) for k in ("long", "short")}
    if arch in ("qwen2", "qwen2moe") or "blk.0.attn_q.bias" in header.tensors:
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        if arch == "llama":  # Llama's attention_bias: the output projection too
            layer["attn_output.bias"] = (hidden,)
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        layer |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
    if arch in ("gemma2", "gemma3"):
        layer |= {"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)}
    if arch == "phi3":  # fused q|k|v and gate|up, as in the checkpoints
        for key in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            del layer[key]
        layer |= {"attn_qkv.weight": (hidden, q + 2 * kv), "ffn_up.weight": (hidden, 2 * ff)}
    if arch in MOE:  # the feed-forward is the experts: a router and each projection stacked over them
        experts, ff_exp = hp["experts"], hp["ff_exp"]
        for key in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
            del layer[key]
        layer |= {"ffn_gate_inp.weight": (hidden, experts), "ffn_gate_exps.weight": (hidden, ff_exp, experts),
                  "ffn_up_exps.weight": (hidden, ff_exp, experts), "ffn_down_exps.weight": (ff_exp, hidden, experts)}
        if hp["ff_shexp"]:
            layer |= {"ffn_gate_inp_shexp.weight": (hidden,), "ffn_gate_shexp.weight": (hidden, hp["ff_shexp"]),
                      "ffn_up_shexp.weight": (hidden, hp["ff_shexp"]), "ffn_down_shexp.weight": (hp["ff_shexp"], hidden)}
    if arch == "gpt-oss":  # biases on every projection, a sink per head, post_attention_norm before the FFN
        del layer["ffn_norm.weight"]
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.bias": (hidden,),
                  "attn_sinks.weight": (hp["heads"],), "post_attention_norm.weight": (hidden,),
                  "ffn_gate_inp.bias": (hp["experts"],), "ffn_gate_exps.bias": (hp["ff_exp"], hp["experts"]),
                  "ffn_up_exps.bias": (hp["ff_exp"], hp["experts"]), "ffn_down_exps.bias": (hidden, hp["experts"])}
    if arch == "lfm2":  # the final norm is token_embd_norm; a conv layer has no attention
        del out["output_norm.weight"]
        out["token_embd_norm.weight"] = ((hidden,), True)
        layer |= {"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)}
        conv = {"attn_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
        conv_layer = {k: v for k, v in layer.items() if k in conv} | {
            "shortconv.conv.weight": (hp["conv_kernel"], hidden), "shortconv.in_proj.weight": (hidden, 3 * hidden),
            "shortconv.out_proj.weight": (hidden, hidden)}
        for i in range(hp["layers"]):
            out |= {f"blk.{i}.{k}": (shape, True) for k, shape in (conv_layer if i in hp["conv_layers"] else layer).items()}
        return out
    for i in range(hp["layers"]):
        out |= {f"blk.{i}.{k}": (shape, True) for k, shape in layer.items()}
    return out


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _check_tensors(header: GGUFHeader, expected: dict[str, tuple[tuple[int, ...], bool]]) -> None:
    name = header.path.name
    for tname, info in header.tensors.items():
        if tname not in expected:
            raise GGUFFormatError(f"{name}: tensor {tname} has no place in this model "
                                  f"({header.get('general.architecture')}, {sum(1 for _ in expected)} tensors expected)")
        shape, _ = expected[tname]
        if _squeezed(info.shape) != _squeezed(shape):  # llama.cpp pads shapes with 1s: [n] is [n, 1]
            raise GGUFFormatError(f"{name}: tensor {tname} has shape {list(info.shape)}; the model's hyperparameters "
                                  f"make it {list(shape)}")
        if (len(shape) == 1 or tname.endswith(".bias")) and info.type_name not in _FLOAT_TYPES:
            raise GGUFFormatError(f"{name}: tensor {tname} is {info.type_name}; norms and biases must be "
                                  f"{', '.join(_FLOAT_TYPES)}")
    missing = [t for t, (_, required) in expected.items() if required and t not in header.tensors]
    if missing:
        raise GGUFFormatError(f"{name}: {len(missing)} tensors are missing, first {', '.join(missing[:4])}")


def _rope_scaling(header: GGUFHeader, arch: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """The file's `rope.scaling.*` keys as transformers' rope_parameters (None: no scaling):
    "linear" (factor) and "yarn" (factor, original context, beta_fast / beta_slow). Other types,
    and an extra `attn_factor` beside YaRN's own 0.1 ln(factor) + 1, are refused by name."""
    get = lambda key: header.get(f"{arch}.rope.scaling.{key}")  # noqa: E731
    kind = get("type")
    if kind in (None, "none"):
        return None
    name = header.path.name
    factor = get("factor")
    if isinstance(factor, (bool, str, ArrayValue)) or factor is None or not math.isfinite(factor) or factor <= 0:
        raise GGUFFormatError(f"{name}: metadata {arch}.rope.scaling.factor must be a positive number, got {factor!r}")
    params = {"rope_type": kind, "rope_theta": config["rope_theta"], "factor": float(factor)}
    if kind == "linear":
        return params
    if kind != "yarn":
        raise UnsupportedGGUFError(f"{name}: RoPE scaling {kind!r} is not supported; supported: linear, yarn")
    if get("attn_factor") not in (None, 1.0):
        raise UnsupportedGGUFError(f"{name}: {arch}.rope.scaling.attn_factor {get('attn_factor')} beside YaRN's "
                                   "own attention factor is not supported")
    original = get("original_context_length")
    if isinstance(original, (bool, float, str, ArrayValue)) or original is None or original < 1:
        raise GGUFFormatError(f"{name}: YaRN needs {arch}.rope.scaling.original_context_length (a positive integer)")
    params["original_max_position_embeddings"] = int(original)
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if get(key) is not None:
            params[hf_key] = float(get(key))
    return params


def _moe_hyperparameters(name: str, arch: str, ints: dict[str, int | None]) -> dict[str, int]:
    """The experts' counts and sizes. llama.cpp's rules where a size is missing: an expert's
    feed-forward is feed_forward_length / experts used, the shared expert's (Qwen2-MoE) is
    feed_forward_length (llama-model.cpp, QWEN2MOE / QWEN3MOE)."""
    experts, used = ints["expert_count"], ints["expert_used_count"]
    if experts is None or used is None:
        raise GGUFFormatError(f"{name}: metadata {arch}.expert_count and {arch}.expert_used_count are required "
                              "for a mixture of experts")
    if used > experts:
        raise GGUFFormatError(f"{name}: {arch}.expert_used_count {used} exceeds {arch}.expert_count {experts}")
    ff = ints["feed_forward_length"]
    ff_exp = ints["expert_feed_forward_length"] or ff // used
    ff_shexp = (ints["expert_shared_feed_forward_length"] or ff) if arch == "qwen2moe" else 0
    return {"experts": experts, "experts_used": used, "ff_exp": ff_exp, "ff_shexp": ff_shexp}


def _moe_config(hp: dict[str, Any], normalize: bool) -> dict[str, Any]:
    """Qwen2/3-MoE's keys: every layer sparse; the top-k weights renormalised for Qwen3-MoE, not for
    Qwen2-MoE (what llama.cpp does for each, unless the file says `expert_weights_norm`)."""
    return {
        "num_experts": hp["experts"], "num_experts_per_tok": hp["experts_used"],
        "moe_intermediate_size": hp["ff_exp"], "norm_topk_prob": bool(normalize),
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        **({"shared_expert_intermediate_size": hp["ff_shexp"]} if hp["ff_shexp"] else {}),
    }


def _lfm2_conv_layers(header: GGUFHeader) -> list[int]:
    """LFM2's short-convolution layers: where `lfm2.attention.head_count_kv` (an array, one per
    layer, as llama.cpp's converter writes it) is 0; GGUFFormatError when it is not such an array."""
    key = "lfm2.attention.head_count_kv"
    counts = header.numbers(key)
    layers = header.get("lfm2.block_count")
    if not isinstance(header.get(key), ArrayValue) or len(counts) != layers or any(
            isinstance(c, float) or not 0 <= c <= 1024 for c in counts) or not any(counts):
        raise GGUFFormatError(f"{header.path.name}: {key} must be an array of {layers} KV head counts "
                              "(0 for a short-convolution layer, at least one attention layer)")
    return [i for i, c in enumerate(counts) if c == 0]


def _lfm2_config(header: GGUFHeader, hp: dict[str, Any]) -> dict[str, Any]:
    """LFM2's keys: which layers convolve, the kernel, the file's feed-forward size as it is (no
    2/3 adjustment), a tied head unless the file has `output`."""
    return {
        "layer_types": ["conv" if i in hp["conv_layers"] else "full_attention" for i in range(hp["layers"])],
        "conv_L_cache": hp["conv_kernel"], "block_auto_adjust_ff_dim": False,
        "norm_eps": float(header.get("lfm2.attention.layer_norm_rms_epsilon") or 1e-5),
    }


def _gpt_oss_config(get, hp: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's keys: experts of expert_feed_forward_length, the window on even layers (llama.cpp's
    pattern 2), biases on every attention projection; the clamped SwiGLU's constants are not in the
    file (llama.cpp: alpha 1.702, limit 7, as the checkpoints' config)."""
    layers = hp["layers"]
    return {
        "num_local_experts": hp["experts"], "num_experts_per_tok": hp["experts_used"],
        "intermediate_size": hp["ff_exp"], "attention_bias": True,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "swiglu_limit": 7.0,
    }


def _gemma2_config(get, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's keys: the window on alternate layers (llama.cpp's pattern 2: even layers local),
    the two soft-caps, and the query scale, which the file does not carry: llama.cpp takes
    hidden / heads for the 46-layer model (27B: 144) and the head size otherwise (llama-model.cpp,
    LLM_ARCH_GEMMA2), as the checkpoints' query_pre_attn_scalar says."""
    layers = config["num_hidden_layers"]
    return {
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if layers == 46 else config["head_dim"],
        "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(get("final_logit_softcapping", 30.0)),
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }


def _gemma3_config(get, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys: llama.cpp stores the window but not the layer pattern (5 local : 1 global,
    as llama.cpp and transformers assume) nor the local RoPE base (10,000 in both)."""
    window = get("attention.sliding_window")
    layers = config["num_hidden_layers"]
    return {
        "sliding_window": None if window is None else int(window),
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "query_pre_attn_scalar": config["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }


def check_file(path: str | Path) -> dict[str, Any]:
    """Read and check a GGUF file's header and model (no tensor data read); return its config.
    GGUFFormatError (one line) for a malformed file. What `octavo serve FILE.gguf` does before
    it loads anything."""
    return hf_config(read_header(path))
