"""Which Hugging Face architectures Octavo runs, and the one translation of their config to ModelConfig."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from octavo.config import ModelConfig, MoEConfig, RopeConfig
from octavo.hf_fields import window_layer_types

# architecture name -> (q/k/v projections carry a bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool | None, bool]] = {
    "LlamaForCausalLM": (None, False),  # None: read `attention_bias` from the config
    "MistralForCausalLM": (None, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (None, True),
    "Gemma3ForCausalLM": (None, True),
    "Gemma2ForCausalLM": (None, False),
    "Phi3ForCausalLM": (None, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (None, True),
    "GptOssForCausalLM": (None, False),
    "Lfm2ForCausalLM": (False, True),
}
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")


class UnsupportedModelError(ValueError):
    pass


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a model directory needs config.json")
    return json.loads(path.read_text())


def _rope_config(hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """The model's RoPE: its rule (transformers 5 writes `rope_parameters`, theta included; 4.x
    writes `rope_theta` + `rope_scaling`), and the per-pair frequency factors a GGUF carries
    (`rope_freq_factors`, which gguf_arch.hf_config reads from the file's `rope_freqs` tensor)."""
    factors = hf.get("rope_freq_factors")
    rope = _rope_rule(hf, default_theta)
    return rope if factors is None else dataclasses.replace(rope, freq_factors=tuple(float(f) for f in factors))


def _rope_rule(hf: dict[str, Any], default_theta: float) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", default_theta)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, scaling_type="linear", factor=float(merged["factor"]))
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            scaling_type="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "yarn":
        # (no original context named: the model's own, as transformers reads such a config)
        original = int(merged.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 4096))
        factor = float(merged.get("factor") or int(hf.get("max_position_embeddings", original)) / original)
        return RopeConfig(
            theta=theta, scaling_type="yarn", factor=factor, original_max_position=original,
            beta_fast=float(merged.get("beta_fast") or 32.0), beta_slow=float(merged.get("beta_slow") or 1.0),
            attention_factor=_yarn_attention_factor(merged, factor), truncate=bool(merged.get("truncate", True)),
        )
    if rope_type in ("longrope", "su"):
        return _longrope(hf, merged, theta)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, longrope"
    )


def _longrope(hf: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """Phi-3 128k / Phi-3.5 / Phi-4-mini's LongRoPE, as transformers computes it: per-pair factors,
    cos and sin times sqrt(1 + ln(factor) / ln(original context)) (factor: the contexts' ratio
    unless given). transformers picks the long factors per forward when the sequence passes the
    original context; a paged cache keeps keys rotated once, so the set is picked once by the
    context served, as llama.cpp does: long when the model's context passes the original (the
    engine switches to the short set for a --max-model-len within it: see `for_context`)."""
    original = int(params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                   or hf.get("max_position_embeddings", 4096))
    max_position = int(hf.get("max_position_embeddings", original))
    factor = float(params.get("factor") or max_position / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, scaling_type="longrope", factor=factor, original_max_position=original,
                      attention_factor=float(attention), short_factor=tuple(float(f) for f in params["short_factor"]),
                      long_factor=tuple(float(f) for f in params["long_factor"]), long=max_position > original)


def for_context(rope: RopeConfig, max_len: int) -> RopeConfig:
    """The RoPE to serve contexts of up to `max_len` tokens with: LongRoPE's short factors when they
    fit the original context (transformers' choice for every such sequence), else as configured."""
    if rope.scaling_type != "longrope":
        return rope
    return dataclasses.replace(rope, long=max_len > rope.original_max_position)


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's scale of cos and sin: the config's `attention_factor`, else 0.1 ln(factor) + 1 (the
    paper's; with `mscale` and `mscale_all_dim`, the ratio of the two such terms), as transformers."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)


def _rotary_dim(hf: dict[str, Any], head_dim: int) -> int | None:
    """The rotary part of each head where `partial_rotary_factor` < 1 (Phi-4-mini: 0.75 of 128),
    as transformers rounds it; None when all of it rotates."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial == 1.0:
        return None
    if not 0 < partial < 1:
        raise UnsupportedModelError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    return int(head_dim * partial) // 2 * 2


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _gemma_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 and 3's extras: GeGLU (tanh GELU), the query scale, Gemma 3's local layers' own RoPE
    base (transformers 5 nests both bases under `rope_parameters`; older configs give `rope_theta`
    and `rope_local_base_freq`), the default layer pattern (Gemma 3: 5 local : 1 global; Gemma 2:
    alternating), and Gemma 2's soft-capping of attention scores and final logits."""
    gemma2 = arch == "Gemma2ForCausalLM"
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        rope = _rope_config({"rope_parameters": params["full_attention"]}, 1_000_000.0)
        local = _rope_config({"rope_parameters": params.get("sliding_attention") or {}})
    elif gemma2:
        rope = local = _rope_config(hf, 10000.0)
    else:
        rope = _rope_config(hf, 1_000_000.0)
        local = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10000.0)))
    layers = int(hf["num_hidden_layers"])
    window, types = window_layer_types({"model_type": "gemma2" if gemma2 else "gemma3", **hf}, layers)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma activation {act!r} is not supported; supported: gelu_pytorch_tanh")
    return {
        "rope": rope, "local_rope": local, "hidden_act": "gelu_tanh", "sliding_window": window, "layer_types": types,
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attn_logit_softcap": _softcap(hf, "attn_logit_softcapping", gemma2),
        "final_logit_softcap": _softcap(hf, "final_logit_softcapping", gemma2),
    }


def _softcap(hf: dict[str, Any], key: str, allowed: bool) -> float | None:
    value = hf.get(key)
    if value is None:
        return None
    if not allowed:
        raise UnsupportedModelError(f"Gemma 3 with {key} is not supported (Gemma 3 has none; Gemma 2 has it)")
    if not float(value) > 0:
        raise UnsupportedModelError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Qwen2/3-MoE's or gpt-oss's experts. Every layer must be sparse (what llama.cpp writes for
    Qwen2/3-MoE): a config with dense layers among them (`mlp_only_layers`, `decoder_sparse_step`
    > 1) is refused by name."""
    if arch == "GptOssForCausalLM":  # top-k logits then softmax, biases everywhere, clamped SwiGLU, sinks
        return {"moe": MoEConfig(
            num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["intermediate_size"]), routing="topk_softmax", router_bias=True,
            expert_bias=True,
        ), "hidden_act": "swiglu_oai", "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)), "attn_sinks": True}
    layers = int(hf["num_hidden_layers"])
    dense = set(hf.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % int(hf.get("decoder_sparse_step", 1))}
    if dense:
        raise UnsupportedModelError(f"{arch} with dense feed-forward layers among the sparse ones (layers "
                                    f"{sorted(dense)[:8]}) is not supported; every layer must be a mixture of experts")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return {"moe": MoEConfig(
        num_experts=int(hf["num_experts"]), top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
    )}


def _lfm2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """LFM2's extras: which layers are short convolutions (`layer_types` "conv", or every layer not
    in `full_attn_idxs`), the kernel size, the feed-forward size as transformers derives it
    (`block_auto_adjust_ff_dim`: 2/3 of it, times `block_ffn_dim_multiplier`, rounded up to
    `block_multiple_of`), `norm_eps`, a tied head by default."""
    layers = int(hf["num_hidden_layers"])
    if hf.get("conv_bias"):
        raise UnsupportedModelError("LFM2 with conv_bias (biases on the short convolutions) is not supported")
    names = hf.get("layer_types")
    if names is None:
        full = set(hf.get("full_attn_idxs") if hf.get("full_attn_idxs") is not None else range(layers))
        names = ["full_attention" if i in full else "conv" for i in range(layers)]
    if set(names) - {"conv", "full_attention"}:
        raise UnsupportedModelError(f"LFM2 layer types {sorted(set(names))} are not supported; supported: conv, full_attention")
    inter = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        if hf.get("block_ffn_dim_multiplier") is not None:
            multiple = int(hf.get("block_multiple_of", 256))
            inter = multiple * -(-int(float(hf["block_ffn_dim_multiplier"]) * inter) // multiple)
    return {"layer_types": tuple("conv" if n == "conv" else "full" for n in names), "sliding_window": None,
            "conv_kernel": int(hf.get("conv_L_cache", 3)), "intermediate_size": inter,
            "rms_norm_eps": float(hf.get("norm_eps", hf.get("rms_norm_eps", 1e-5))),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True)))}


def _window_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Mistral-style or Qwen sliding windows (see hf_fields.window_layer_types)."""
    window, types = window_layer_types(hf, int(hf["num_hidden_layers"]))
    return {"sliding_window": window, "layer_types": types}


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Translate a Hugging Face config dict; raises UnsupportedModelError naming what is supported."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or hf.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    qkv_bias = bool(hf.get("attention_bias", False)) if bias is None else bias
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    eos = _as_tuple((generation or {}).get("eos_token_id")) or _as_tuple(hf.get("eos_token_id"))
    extras = _gemma_fields(hf, arch) if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM") else _window_fields(hf)
    if arch in MOE_ARCHITECTURES:
        extras |= _moe_fields(hf, arch)
    if arch == "Lfm2ForCausalLM":
        extras |= _lfm2_fields(hf)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rotary_dim=_rotary_dim(hf, int(hf.get("head_dim") or hidden // num_heads)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(hf),
        max_position=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's bias is on q/k/v only.
        o_bias=qkv_bias and arch in ("LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM"),
        qk_norm=qk_norm,
        eos_token_ids=eos,
        bos_token_id=hf.get("bos_token_id"),
    )
    return ModelConfig(**{**fields, **extras})


def load_model_config(model_dir: str | Path) -> ModelConfig:
    generation_path = Path(model_dir) / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
    return model_config_from_hf(read_hf_config(model_dir), generation)


def model_class(architecture: str) -> type:
    """The model file's top module for a supported architecture name."""
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        from octavo.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {architecture!r} is not supported")
    if architecture == "Lfm2ForCausalLM":
        from octavo.models.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    from octavo.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
