"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into per-layer
A and B matrices for the model's projections, with the scaling folded into B."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.config import ModelConfig

# PEFT target name -> (our fused projection, part index within it)
TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights: (layer, PEFT target) -> (A [rank, in], B * scaling [out, rank])."""

    lora_id: int
    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    cache_key: str = ""  # set by LoRASlots: a digest of its files (prefix-cache hashes; see adapter_digest)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _fail(path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {why}")


def load_peft_adapter(path: str | Path, lora_id: int, name: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter for a model of `cfg`; ValueError says what is wrong (no such
    directory, rank over `max_rank`, targets or shapes that do not fit the model, PEFT features
    Octavo does not apply)."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise _fail(path, "no adapter_config.json there (a PEFT LoRA directory is expected)")
    if not weights_file.is_file():
        raise _fail(path, "no adapter_model.safetensors there")
    try:
        conf = json.loads(config_file.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, nested absurdly
        raise _fail(path, f"adapter_config.json cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(conf, dict):
        raise _fail(path, "adapter_config.json must hold a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type {str(conf.get('peft_type'))[:40]!r} is not LORA")
    rank, alpha = conf.get("r", 0), conf.get("lora_alpha", conf.get("r", 0))
    for key, value in (("r", rank), ("lora_alpha", alpha)):
        # compared, not converted: NaN and infinity fail the comparison, a 400-digit int does not overflow
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e6 <= value <= 1e6:
            raise _fail(path, f"{key} must be a number of reasonable size, got {str(value)[:40]!r}")
    if rank != int(rank):
        raise _fail(path, f"rank {rank} is not an integer")
    rank = int(rank)
    if not 1 <= rank <= max_rank:
        raise _fail(path, f"rank {rank} exceeds --max-lora-rank {max_rank}" if rank > max_rank else f"rank {rank} is invalid")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if conf.get(key):
            raise _fail(path, f"{why} is not supported")
    init = conf.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(("pissa", "olora", "corda", "eva", "loftq")):
        # these initialisations also change the base model's weights (PiSSA keeps the residual of the
        # principal singular values): the adapter is only right on that changed base, which is not
        # what is served here; served on the original base it gives wrong answers, silently
        raise _fail(path, f"init_lora_weights {init!r} adapters need the base model their training changed "
                          "(convert the adapter to a plain LoRA first, as PEFT's save_pretrained("
                          "path_initial_model_for_weight_conversion=...) does)")
    if conf.get("bias", "none") != "none" or conf.get("modules_to_save"):
        raise _fail(path, "LoRA biases and modules_to_save are not supported")
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise _fail(path, "per-module rank_pattern / alpha_pattern are not supported")
    alpha = float(alpha)
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors' own error type, OSError, a bad header...
        raise _fail(path, f"adapter_model.safetensors cannot be read ({str(exc)[:200]})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _fail(path, f"tensor {key} is not a LoRA A/B of a Llama projection")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS or layer >= cfg.num_layers:
            raise _fail(path, f"tensor {key} targets a module this model does not have")
        pairs.setdefault((layer, target), {})[which] = tensor
    sizes = _projection_sizes(cfg)
    weights = {}
    for (layer, target), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"layer {layer} {target} lacks its lora_{'B' if 'A' in ab else 'A'}")
        if not (ab["A"].is_floating_point() and ab["B"].is_floating_point()):
            raise _fail(path, f"layer {layer} {target}: weights must be floating point, not {ab['A'].dtype}/{ab['B'].dtype}")
        a, b = ab["A"].float(), ab["B"].float()
        in_f, out_f = sizes[target]
        if a.shape != (rank, in_f) or b.shape != (out_f, rank):
            raise _fail(path, f"layer {layer} {target}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                              f"rank {rank} and the model's {in_f} -> {out_f}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _fail(path, f"layer {layer} {target}: weights hold NaN or infinity")
        weights[(layer, target)] = (a, b * scaling)
    if not weights:
        raise _fail(path, "holds no LoRA weights")
    return LoRAAdapter(lora_id, name, rank, weights)


def _projection_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
