"""GGUF architectures Octavo reads (llama, and with it Mistral; qwen2, qwen3, gemma3): a file's
metadata as a Hugging Face config dict, its tensor names as checkpoint names, and its tensors in
the checkpoint's conventions (llama.cpp's converter interleaves Llama q/k rows and stores Gemma's
norm weights as 1 + w; both are undone here, so every loader path sees one convention).

llama.cpp writes Mistral checkpoints under the `llama` architecture, so "mistral" GGUFs are llama
files. No weights are touched here beyond reshaping rows; see loader.py for what is loaded how.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")

_HF_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
}
# Gemma 3 has four norms per layer: llama.cpp's `ffn_norm` is the one before the feed-forward.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
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
    return GEMMA_CHAT_TEMPLATE if arch == "gemma3" else None


class UnsupportedGGUFError(ValueError):
    pass


def field(reader, key: str) -> Any:
    found = reader.fields.get(key)
    return None if found is None else found.contents()


def architecture(reader) -> str:
    """The file's `general.architecture`; UnsupportedGGUFError names the supported ones."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)} "
            "(Mistral models are written as llama)"
        )
    return arch


def hf_name(gguf_name: str, arch: str) -> str:
    """A GGUF tensor name (`blk.3.attn_q.weight`) -> the checkpoint's (`model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in names:
        raise UnsupportedGGUFError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")
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
    if model_type == "gemma3_text" and is_float and name.endswith("norm.weight"):
        return rows - np.float32(1.0)
    return rows


def _stop_ids(reader) -> list[int]:
    """The file's eos id and the id of every end-of-turn token in its vocabulary."""
    ids = []
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        ids.append(int(eos))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        wanted = {t.encode() for t in END_OF_TURN_TOKENS}
        for i, part in enumerate(tokens.data):
            if bytes(tokens.parts[part]) in wanted and i not in ids:
                ids.append(i)
    return ids


def hf_config(reader) -> dict[str, Any]:
    """The config.json a checkpoint of this file's model would have (transformers loads it)."""
    arch = architecture(reader)
    get = lambda key, default=None: default if field(reader, f"{arch}.{key}") is None else field(reader, f"{arch}.{key}")  # noqa: E731
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf_arch, model_type = _HF_ARCH[arch]
    stop_ids = _stop_ids(reader)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None),
        "torch_dtype": "float32",
    }
    if arch == "qwen2" or any(t.name == "blk.0.attn_q.bias" for t in reader.tensors):
        config["attention_bias"] = True  # Qwen2: q/k/v; Llama: q/k/v and the output projection
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    return config


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
