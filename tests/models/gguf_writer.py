"""Small random-weight GGUF files written with gguf-py the way llama.cpp's converter writes each
architecture (its tensor names, q/k rows interleaved for llama, Gemma's norms stored as 1 + w,
Llama 3.1+ RoPE scaling as a `rope_freqs` tensor, linear weights as Q8_0 blocks), and the
transformers model each holds: the oracle of tests/models and tests/oracle on every family."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from octavo.models import gguf_arch

gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hf_model(arch: str):
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                              Lfm2Config, MistralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    config = {
        "llama": LlamaConfig(**COMMON, num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
        # Llama 3.1+ scaling with a knee inside the tests' prompts (wavelengths 16 and 64: one rotary
        # pair kept, two smoothed, five divided by the factor); weights 5x the usual scale, so that
        # attention is sharp enough for greedy tokens to depend on the rotation of far positions
        "llama3": LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE,
                              initializer_range=0.1),
        # YaRN, 4x past an original context of 64 (the tests' prompts reach 166)
        "llama-yarn": LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, initializer_range=0.1,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
        "mistral": MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False),
        # six layers: llama.cpp's Gemma 3 pattern (five local, one global) is not in the file
        "gemma3": Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16, sliding_window=5,
                                   query_pre_attn_scalar=16, tie_word_embeddings=True),
        # Gemma 2: alternating window and global layers; an attention soft-cap of 1 with weights
        # 5x the usual scale, so that the cap bends most scores (Gemma 2's own 50 bends few of a
        # small random model's); the final cap of 30 changes no greedy token (tanh keeps the
        # order) but every logit, which tests/models compares
        "gemma2": Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                               attn_logit_softcapping=1.0, final_logit_softcapping=30.0, initializer_range=0.1,
                               tie_word_embeddings=True),
        # Phi-3: q|k|v and gate|up fused in the checkpoint and the file; a window on every layer
        # (96: shorter than the longest prompts, long enough that a tiny pool still preempts)
        "phi3": Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=96, tie_word_embeddings=False,
                           bos_token_id=2, eos_token_id=1, pad_token_id=0),
        # Phi-3 128k / Phi-4-mini style: LongRoPE past an original context of 64 (4x: 256) with short
        # and long factor sets far apart, and partial rotary (Phi-4-mini's 0.75: 12 of 16 values)
        "phi3-longrope": Phi3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, bos_token_id=2,
                                    eos_token_id=1, pad_token_id=0, initializer_range=0.1,
                                    original_max_position_embeddings=64,
                                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75,
                                                     "original_max_position_embeddings": 64,
                                                     "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                     "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}),
        # eight experts, two per token; Qwen3-MoE renormalises the two weights, Qwen2-MoE does not
        # and adds a shared expert behind a sigmoid gate
        "qwen3moe": Qwen3MoeConfig(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, initializer_range=0.1),
        "qwen2moe": Qwen2MoeConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False, num_experts=8,
                                   num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                   norm_topk_prob=False, initializer_range=0.1),
        # gpt-oss: biases on q/k/v/o, the router and every expert, a sink logit per head, the
        # window (5) on even layers, YaRN 4x past 64 positions, top-k logits then softmax, the
        # clamped SwiGLU at llama.cpp's fixed limit of 7 (the file has no key for it; experts' weights
        # at 0.5, so that a good share of the random model's gate and up values pass the limit)
        "gpt-oss": GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_hidden_layers=4, head_dim=16,
                                num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
                                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(4)],
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                 "beta_slow": 1.0},
                                tie_word_embeddings=False, initializer_range=0.1, attention_bias=True),
        # LFM2: four short-convolution layers (kernel 3) around two attention layers, as its 2:1
        # ratio; the file's feed-forward size is the real one (no 2/3 adjustment); weights 3x the
        # usual scale and the kernels' taps at 1, so that the earlier positions move the greedy tokens
        "lfm2": Lfm2Config(**COMMON, num_hidden_layers=6, conv_L_cache=3, block_auto_adjust_ff_dim=False,
                           layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
                           tie_word_embeddings=True, initializer_range=0.06),
    }[arch]
    torch.manual_seed(0)
    extra = {"attn_implementation": "eager"} if arch == "gpt-oss" else {}  # (sinks: eager attention)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 0.3)  # decisive routing: no near-tie between a token's k-th and next expert
            if name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0)  # sinks that take a real share of each softmax
            if ".experts." in name:
                p.normal_(0.0, hf.config.initializer_range)  # transformers 5 leaves stacked experts at zero
            if arch == "gpt-oss" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.5)
            if name.endswith("conv.conv.weight"):
                p.normal_(0.0, 1.0)  # LFM2: taps that weigh as much as the token's own
    return hf


# llama.cpp's tensor names (gguf-py's TENSOR_NAMES) for each checkpoint name, per layer
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused projections
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
# transformers 5 keeps each layer's experts stacked: [experts, 2 * rows, cols] for gate and up
# (gate first), [experts, hidden, rows] for down; llama.cpp stacks gate, up and down apart
EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.down_proj": ("ffn_down_exps",)}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# gpt-oss (llama.cpp's converter): the pre-FFN norm is `post_attention_norm`, the router
# `ffn_gate_inp` with a bias; experts x @ W with gate / up columns interleaved, split and transposed
GPT_OSS_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
# LFM2 (llama.cpp's converter): the final norm is `token_embd_norm`; per layer its own names
LFM2_LAYER = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
              "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
              "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
              "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down"}


def _gpt_oss_experts(layer: str, rest: str, p: torch.Tensor):
    """(GGUF name, float32 data, the parameter's view) of one gpt-oss stacked-experts parameter."""
    if rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2 rows] -> gate, up [E, rows, hidden]
        for kind, view in (("ffn_gate_exps", p[..., 0::2]), ("ffn_up_exps", p[..., 1::2])):
            yield f"blk.{layer}.{kind}.weight", view.transpose(1, 2).detach().numpy().copy(), view.transpose(1, 2)
    elif rest == "mlp.experts.gate_up_proj_bias":
        for kind, view in (("ffn_gate_exps", p[:, 0::2]), ("ffn_up_exps", p[:, 1::2])):
            yield f"blk.{layer}.{kind}.bias", view.detach().numpy().copy(), view
    elif rest == "mlp.experts.down_proj":  # [E, rows, hidden] -> [E, hidden, rows]
        yield f"blk.{layer}.ffn_down_exps.weight", p.transpose(1, 2).detach().numpy().copy(), p.transpose(1, 2)
    else:
        yield f"blk.{layer}.ffn_down_exps.bias", p.detach().numpy().copy(), p


def llama3_rope_freqs(cfg, head_dim: int) -> np.ndarray | None:
    """What llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes as `rope_freqs` for a
    checkpoint with Llama 3 RoPE scaling: per rotary pair, 1 where the wavelength is shorter than
    original_max_position / high_freq_factor, `factor` where it is longer than
    original_max_position / low_freq_factor, and 1 / ((1 - s) / factor + s) between, s the
    smoothing weight; float32. None for any other RoPE."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _gguf_name(name: str, gemma: bool, file_arch: str = "") -> str:
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight", "model.embedding_norm.weight": "token_embd_norm.weight"}[name]
    _, _, layer, rest = name.split(".", 3)
    if rest == "self_attn.sinks":
        return f"blk.{layer}.attn_sinks.weight"
    module, _, suffix = rest.rpartition(".")
    names = GEMMA_LAYER if gemma else {"gpt-oss": GPT_OSS_LAYER, "lfm2": LFM2_LAYER}.get(file_arch, LAYER)
    return f"blk.{layer}.{names[module]}.{suffix}"


def _interleave_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute for llama q/k rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tiny_tokenizer(w, vocab_size: int, gemma: bool) -> None:
    """A vocabulary of `vocab_size` entries, as the architecture's files carry one: byte-level BPE
    with one merge, or for Gemma a SentencePiece one (pad, eos, bos, unk, then single letters and
    pieces) with scores, so that transformers makes a tokenizer of it."""
    if not gemma:  # one merge ("t" + "1"), as a Llama 3 file has merges and no scores
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["t", "1"] + [f"t{i}" for i in range(1, vocab_size - 1)])
        w.add_token_types([1] * vocab_size)
        w.add_token_merges(["t 1"])
        return
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + [chr(ord("a") + i) for i in range(26)]
    pieces += [f"\u2581{chr(ord('a') + i % 26)}{chr(ord('a') + i // 26)}" for i in range(vocab_size - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(vocab_size - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (vocab_size - 4))
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)


def _tensors(hf, file_arch: str):
    """(GGUF name, checkpoint name, float32 data as the file holds it, a view of the parameter's part)
    for every tensor the converter writes."""
    cfg, gemma = hf.config, file_arch in ("gemma2", "gemma3")
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = p.detach().numpy().astype(np.float32)
        _, _, layer, rest = name.split(".", 3) if name.startswith("model.layers.") else ("", "", "", "")
        if file_arch == "gpt-oss" and rest.startswith("mlp.experts."):
            for gguf_name, part, view in _gpt_oss_experts(layer, rest, p):
                yield gguf_name, name, part, view
        elif rest in EXPERTS:  # stacked experts: gate and up apart
            parts = np.split(data, len(EXPERTS[rest]), axis=1)
            views = torch.chunk(p, len(EXPERTS[rest]), dim=1)
            for gguf_name, part, view in zip(EXPERTS[rest], parts, views):
                yield f"blk.{layer}.{gguf_name}.weight", name, part, view
        elif name.endswith("shared_expert_gate.weight"):
            yield _gguf_name(name, gemma), name, data.reshape(-1), p  # llama.cpp's [hidden]
        elif name.endswith("conv.conv.weight"):  # LFM2's Conv1d [hidden, 1, kernel] -> [hidden, kernel]
            yield _gguf_name(name, gemma, file_arch), name, data.reshape(data.shape[0], -1), p
        else:
            yield _gguf_name(name, gemma, file_arch), name, data, p


def write_gguf(hf, file_arch: str, path, types: dict | None = None) -> None:
    """`hf`'s weights as llama.cpp writes them; the model's own linear weights (and experts) become
    the dequantized Q8_0 values (or `types`' type per GGUF tensor kind, e.g. {"attn_v": Q4_1}),
    so that it stays the model the file holds. A mixture of experts' router stays F32, as the
    converter keeps it."""
    from gguf.quants import dequantize, quantize

    cfg, gemma = hf.config, file_arch in ("gemma2", "gemma3")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), file_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    if file_arch == "lfm2":  # a KV head count per layer, 0 for a short convolution; its kernel size
        w.add_head_count_kv([0 if t == "conv" else cfg.num_key_value_heads for t in cfg.layer_types])
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0 if file_arch == "gemma3" else float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.norm_eps if file_arch == "lfm2" else cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(1)
    add_tiny_tokenizer(w, cfg.vocab_size, gemma)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    if file_arch == "phi3" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if file_arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if file_arch == "gpt-oss":
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    elif getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn":  # llama.cpp's rope.scaling keys
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    factors = llama3_rope_freqs(cfg, head_dim)
    if factors is not None:  # Llama 3.1+: the converter writes the scaling as this tensor, no metadata
        w.add_tensor("rope_freqs.weight", factors)
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:  # the rotary part of each head (llama.cpp: int(partial * hidden) // heads)
        w.add_rope_dimension_count(int(partial * cfg.hidden_size) // cfg.num_attention_heads)
    if rope.get("rope_type") == "longrope":  # llama.cpp's Phi-3 converter: two factor tensors, the
        original = rope["original_max_position_embeddings"]  # original context and its attention factor
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for gguf_name, name, data, p in _tensors(hf, file_arch):
        rotary = file_arch == "llama" and any(name.endswith(f"{p}_proj.{k}") for p in "qk" for k in ("weight", "bias"))
        if rotary:
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _interleave_rope(data, heads)
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0
        if (data.ndim >= 2 and gguf_name.endswith(".weight") and "embed" not in name and "ffn_gate_inp" not in gguf_name
                and "shortconv.conv" not in gguf_name):
            kind = (types or {}).get(gguf_name.split(".")[-2], q8)
            blocks = quantize(data, kind)
            w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
            with torch.no_grad():  # the interleaving moves whole rows: undo it on the dequantized rows
                back = dequantize(blocks, kind).reshape(data.shape)
                if rotary:
                    back = gguf_arch._unpermute_rope(back, heads)
                p.copy_(torch.from_numpy(back))
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
