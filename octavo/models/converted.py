"""Where a GGUF file's conversion lives in the cache and whether it is whole. `loader.convert_gguf`
writes it; `octavo serve FILE.gguf` looks here before it checks the file (a file converted was
checked then, and its content has the same key). Imports neither torch nor numpy."""

from __future__ import annotations

from pathlib import Path

from octavo.cache import cache_dir
from octavo.models.gguf_file import GGUFHeader, read_header

# a subdirectory: never taken for HF weights. v2: K-quant and Q5 tensors are kept as blocks (v1
# dequantized them); v3: only the tensors that differ from the file's bytes, the rest read from the GGUF
# (loader._gguf_tensors); v4: MXFP4 kept as the file's blocks (v3 rewrote them as Q8_0). A directory
# converted before is converted again.
GGUF_BLOCKS_FILE = "gguf-blocks/blocks-v4.safetensors"


def converted_path(header: GGUFHeader, name: str) -> Path:
    """The directory for the file of `header` under `name`, keyed by its content
    (`GGUFHeader.content_key`): a file replaced in place with the same size and time gets another."""
    return cache_dir() / "models" / f"{name}-{header.content_key()[:16]}"


def is_converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / GGUF_BLOCKS_FILE).is_file()


def converted_dir(gguf_path: Path, name: str | None = None) -> Path | None:
    """The directory this file was converted into (under `name`, default its stem), or None; reads
    the header only (milliseconds: GGUFFormatError for one that is not a GGUF), checks nothing."""
    out = converted_path(read_header(gguf_path), name or gguf_path.stem)
    return out if is_converted(out) else None
