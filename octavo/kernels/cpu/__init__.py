"""Builds (once per machine, cached) and loads the C++ CPU kernels; None when they can't be built."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# -march=native: the build is cached per machine (the key includes the CPU flags), so it may use
# whatever vector units this CPU has. -fopenmp: at::parallel_for is an OpenMP region in the
# header; the library resolves to the libgomp torch already loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where the build lives: keyed by the source, the flags, torch, Python and the CPU."""
    import torch

    from octavo.models.loader import cache_dir

    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, platform.python_version(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu-{key}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (with `paged_attention`), or None if this machine can't build it.

    Set OCTAVO_CPU_KERNELS=0 to skip it (the torch reference kernels are used instead).
    The first call on a machine compiles for ~30-60 s; later calls load the cached library.
    """
    if os.environ.get("OCTAVO_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):
            logger.info("compiling Octavo's CPU kernels (once per machine, ~1 min) into %s", directory)
        return load_extension(
            name="octavo_cpu_kernels",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers, ...: the reference kernels still work
        logger.warning("Octavo's CPU kernels are unavailable (%s); using the slower torch reference", exc)
        return None


def has_onednn_linear() -> bool:
    """Whether this torch exposes oneDNN's matmul on plain tensors (an op Inductor uses on CPUs)."""
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x, weight, bias=None):
    """Same contract as `octavo.kernels.reference.linear`, through oneDNN instead of MKL's sgemm.

    Measured on a 2-core AVX2 EPYC (docs/BENCHMARKS.md): 7-22% faster at 2,048 rows and ~37%
    faster for the 49,152-wide LM head at ~36 rows; within noise at decode shapes.
    """
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# Query tokens per work item on multi-token spans: 16 tokens x all heads share each key block
# while it is in L1. Chosen, not tuned: other tile sizes have not been measured.
Q_TILE = 16


def paged_attention(q, k_cache, v_cache, meta, scale: float):
    """Same contract as `octavo.kernels.reference.paged_attention`; float32 CPU tensors only."""
    import torch

    module = load()
    if module is None:
        raise RuntimeError("Octavo's CPU kernels could not be built on this machine (see the log)")
    q = q.contiguous()
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    module.paged_attention(
        out, q, k_cache, v_cache, meta.block_tables, meta.query_starts, meta.query_lens, meta.context_lens, scale, Q_TILE
    )
    return out
