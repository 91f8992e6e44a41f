"""Safetensors files of weights as the loader keeps them in the cache: mapped copy-on-write (nothing
read until used, the page cache's pages shared between processes), and written whole or not at all,
either at once or by a thread while the model already serves (`write_later`: a first start answers
before its 800 MB of prepared layers reach the disk)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_DTYPES = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8, "I16": np.int16,
           "I32": np.int32, "I64": np.int64, "BF16": np.int16}
_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8", torch.int8: "I8",
          torch.int16: "I16", torch.int32: "I32", torch.int64: "I64"}


def map_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, name -> tensor) of a safetensors file, each tensor a copy-on-write view of the
    file mapped into memory: nothing is read until used, pages used are the page cache's (shared
    between processes), a write stays private. ValueError for a file that is not whole."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"{path} is truncated (header of {n} bytes)")
        header = json.loads(fh.read(n))
    metadata = header.pop("__metadata__", {}) or {}
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n, shape=(size - 8 - n,)) if size > 8 + n else None
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        if not 0 <= begin <= end <= size - 8 - n or end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name} lies outside the file")
        array = data[begin:end].view(dtype).reshape(shape) if end > begin else np.empty(shape, dtype)
        tensor = torch.from_numpy(array)
        tensors[name] = tensor.view(torch.bfloat16) if info["dtype"] == "BF16" else tensor
    return metadata, tensors


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` (CPU) as a safetensors file at `path`, whole or not at all (a temporary file in the
    same folder, then an atomic rename). The tensors' bytes go to the file straight from their
    memory (no copy of the whole, and the interpreter's lock released while the kernel writes)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(len(head).to_bytes(8, "little"))
            fh.write(head)
            for t in tensors.values():
                if t.numel():
                    fh.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


_pending: dict[Path, threading.Thread] = {}
_pending_lock = threading.Lock()

# Writes wait until the process has answered its first request (the engine calls `release_writes`),
# WRITE_HOLD_S at most, or less when the file is wanted (`wait_for_write`) or the interpreter
# exits: even at nice 19 a write slowed the 1B shape's first answer by ~0.5 s (its copy still
# takes memory bandwidth and a core's time slices from the step's threads).
WRITE_HOLD_S = 10.0
_released = threading.Event()
threading._register_atexit(lambda: _released.set())  # (run before the interpreter joins non-daemon threads)


def release_writes() -> None:
    """Let the writes `write_later` holds start (the engine: its first request has finished)."""
    _released.set()


def write_later(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`write_safetensors` in a thread, returning at once, held until `release_writes` (at most
    WRITE_HOLD_S); a failure (a full or read-only cache) is a warning, as the file is only a
    shortcut for the next start. The process waits for it at exit (not a daemon thread), and
    `wait_for_write` before reading or writing the same path."""
    def write() -> None:
        try:
            _released.wait(WRITE_HOLD_S)
            # the lowest priority: a step's threads (which wait for each other at every op) keep
            # the cores; the file is written in what they leave (measured: at the same priority the
            # 1B shape's first answer took 1.5 s longer, its step threads starved by the copy)
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # (Linux: per thread)
            write_safetensors(path, tensors, metadata)
        except OSError as exc:
            logger.warning("could not keep %s for the next start (%s)", path, exc)
        finally:
            with _pending_lock:
                _pending.pop(path, None)

    _join(path)  # (an earlier write of the same file: held writes stay held)
    # not a daemon even when started from one (an engine loads in a daemon thread, whose flag a
    # thread inherits): the interpreter's exit waits for it instead of cutting the file short
    thread = threading.Thread(target=write, name=f"write {path.name}", daemon=False)
    with _pending_lock:
        _pending[path] = thread
    thread.start()


def wait_for_write(path: Path | None = None) -> None:
    """Until this process's write of `path` (of every file: None) is done; held writes start now."""
    release_writes()
    _join(path)


def _join(path: Path | None) -> None:
    with _pending_lock:
        threads = list(_pending.values()) if path is None else [t for p, t in _pending.items() if p == path]
    for thread in threads:
        thread.join()


def remove_stale_temporaries(folder: Path, prefix: str, older_than_s: float = 3600.0) -> None:
    """Temporary files a killed writer left in `folder` (`.{prefix}*.tmp`), once old enough that no
    live writer can own them."""
    now = time.time()
    for tmp in folder.glob(f".{prefix}*.tmp"):
        try:
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()
        except OSError:
            pass
