"""Fields of a Hugging Face config.json that more than one reader interprets alike: which layers
attend within a sliding window. The model registry (building ModelConfig) and the planner (sizing
from a bare config.json) both read them here, so they never disagree."""

from __future__ import annotations

from typing import Any


# Gemma configs written before `layer_types` name neither it nor a pattern: the family's own
# (Gemma 2 alternates local and global layers, Gemma 3 has five local per global), as transformers assumes
# every Nth layer global where the config names no pattern (gpt-oss alternates as Gemma 2 does)
GEMMA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "gpt_oss": 2}


def window_layer_types(cfg: dict[str, Any], num_layers: int, used: dict[str, str] | None = None) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, "full"/"sliding" per layer; () when no layer slides), from `layer_types`
    (Gemma 3, newer transformers), else `sliding_window_pattern` (every Nth layer global, Gemma
    2/3), else a Mistral-style window on every layer; Qwen2/3 only when `use_sliding_window` is true
    (on its layers from `max_window_layers` on, as transformers builds them). `used` records which
    keys decided it (for `octavo plan`'s report)."""
    used = {} if used is None else used
    window = cfg.get("sliding_window")
    if not window:
        return None, ()
    used["sliding_window"] = "sliding_window"
    if isinstance(cfg.get("layer_types"), list):
        used["num_window_layers"] = "layer_types (sliding_attention entries)"
        types = tuple("sliding" if t == "sliding_attention" else "full" for t in cfg["layer_types"])
    elif cfg.get("sliding_window_pattern") or cfg.get("model_type") in GEMMA_PATTERNS:
        pattern = int(cfg.get("sliding_window_pattern") or GEMMA_PATTERNS[cfg["model_type"]])
        used["num_window_layers"] = f"sliding_window_pattern {pattern}: every {pattern}th layer global"
        types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))
    elif str(cfg.get("model_type", "")).startswith("qwen"):
        if not cfg.get("use_sliding_window"):
            used["sliding_window"] = "sliding_window ignored: use_sliding_window is false"
            return None, ()
        first = int(cfg.get("max_window_layers", num_layers))
        used["num_window_layers"] = "use_sliding_window, layers from max_window_layers"
        types = tuple("sliding" if i >= first else "full" for i in range(num_layers))
    else:
        used["num_window_layers"] = "sliding_window on every layer (Mistral style)"
        types = ("sliding",) * num_layers
    if "sliding" not in types:
        return None, ()
    return int(window), types
