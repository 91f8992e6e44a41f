"""Loads the C++ CPU kernels (built once per machine by `build.py`) and wraps their ops; None when they can't be built."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from types import ModuleType

from octavo.cpu_features import bf16_matmul_speedups, cpu_flags, cpu_has_bf16, weight_prefetch  # noqa: F401
from octavo.kernels.cpu.build import MODULE_NAME, build_dir, cflags, ensure_built  # noqa: F401

logger = logging.getLogger(__name__)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (with `paged_attention`), or None if this machine can't build it.

    Set OCTAVO_CPU_KERNELS=0 to skip it (the torch reference kernels are used instead).
    The first call on a machine compiles for ~25 s (see `build.ensure_built`: one process
    compiles, the others wait for it); later calls import the cached library.
    """
    if os.environ.get("OCTAVO_CPU_KERNELS", "1") == "0":
        return None
    prefetch = weight_prefetch()  # before the try: a bad OCTAVO_WEIGHT_PREFETCH is an error, not "no kernels"
    try:
        import torch  # noqa: F401  (the library links against the torch already loaded)

        library = ensure_built()
        spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.set_weight_prefetch(prefetch)
        return module
    except Exception as exc:  # no compiler, no headers, a build that outlasted the wait...: the reference kernels still work
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


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("Octavo's CPU kernels could not be built on this machine (see the log)")
    return module


def _parts(qweight) -> list:
    return [p.contiguous() for p in qweight] if isinstance(qweight, (list, tuple)) else [qweight.contiguous()]


def pack(qweight, fmt):
    """GGUF-layout blocks [N, row_bytes] (or a list of such parts, stacked by rows: a fused layer
    packed without a stacked copy) -> the layout `quant_linear` reads (same bytes, reordered: see
    quant_linear.cpp)."""
    return _module().pack(_parts(qweight), fmt.code)


def quant_linear(x, packed, fmt, out_features: int, bias=None):
    """Same contract as `octavo.kernels.reference.quant_linear`, W packed by `pack`; float32 x."""
    x = x.contiguous()
    out = _module().quant_linear(x, packed, fmt.code, out_features)  # [num_tokens, out]
    if bias is not None:
        out += bias
    return out


def pack_i8(qweight, fmt):
    """GGUF-layout blocks [N, row_bytes] (or a list of parts, as `pack`) -> the layout
    `quant_linear_i8` reads (same bytes per weight, reordered: see quant_linear_i8.cpp)."""
    return _module().pack_i8(_parts(qweight), fmt.code)


def quant_linear_i8(x, packed, fmt, out_features: int, bias=None):
    """Same contract as `octavo.kernels.reference.quant_linear_int8` (up to the order of float
    sums), W packed by `pack_i8`; float32 x, quantized to int8 per 32 inside."""
    x = x.contiguous()
    out = _module().quant_linear_i8(x, packed, fmt.code, out_features)  # [num_tokens, out]
    if bias is not None:
        out += bias
    return out


def quantize_activations_i8(x):
    """(xq int8 [M, K], dx float32 [M, K / 32]): x as `quant_linear_i8` quantizes it."""
    import torch

    x = x.contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    dx = torch.empty((x.shape[0], x.shape[1] // 32), dtype=torch.float32)
    _module().quantize_activations_i8(xq, dx, x)
    return xq, dx


def dequantize_rows_i8(packed, fmt, rows, in_features: int, out_features: int):
    """Rows `rows` of a `pack_i8` W as float32 [len(rows), in_features], bit for bit as
    `octavo.quantization.dequantize` rebuilds them (the embedding lookup)."""
    import torch

    rows = rows.to(torch.long).contiguous()
    out = torch.empty((rows.shape[0], in_features), dtype=torch.float32)
    _module().dequantize_rows_i8(out, packed, fmt.code, rows, out_features)
    return out


# A child's AMX self-test: a CPU (or a hypervisor) can list AMX and still fault on its first tile
# instruction (llama.cpp's AMX build dies of SIGILL on some of this project's machines), so the
# instructions run first in a forked child whose death costs nothing (no imports: milliseconds).
AMX_PROBE_TIMEOUT_S = 180.0  # one tile product: far less, unless the machine stops the child


def _selftest_in_fork(module, test: str) -> str | None:
    """Run `module.<test>()` in a forked child; None when it passed, else what happened. The
    child calls one C function and exits (no locks, no threads, no imports)."""
    import faulthandler  # imported before the fork: the child must not take the import lock
    import signal
    import time

    pid = os.fork()
    if pid == 0:  # the child
        faulthandler.disable()  # its death by SIGILL is an answer, not a crash to report
        code = 3
        try:
            code = 0 if getattr(module, test)() else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + AMX_PROBE_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"no answer in {AMX_PROBE_TIMEOUT_S:.0f} s"
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        return "died of SIGILL" if os.WTERMSIG(status) == signal.SIGILL else f"killed by signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return None if code == 0 else ("wrong products" if code == 3 else f"exit status {code}")


def _tiles_usable(module, test: str, enable: str, tiles: str, fallback: str) -> bool:
    """The child's self-test `test`, then `enable` in this process (it asks the kernel for the tile
    state); a log line names why not, and the `fallback` the layers use then."""
    why = _selftest_in_fork(module, test)
    if why is not None:
        logger.warning("%s tiles listed but unusable here (self-test in a child process: %s): %s", tiles, why, fallback)
        return False
    if not getattr(module, enable)(True):
        logger.warning("%s tile state refused by the kernel: %s", tiles, fallback)
        return False
    return True


@functools.cache
def amx_enabled() -> bool:
    """Whether the int8 kernels use AMX-INT8 tiles for steps of 16+ rows: asked for (OCTAVO_AMX=1:
    off by default, measured no faster than VNNI here, docs/BENCHMARKS.md), built with them, and a
    child process's self-test passed (then this process asks the kernel for the tile state).
    Decided once per process, with a log line when asked for."""
    module = load()
    if module is None or not module.amx_built() or os.environ.get("OCTAVO_AMX", "0") != "1":
        return False
    if not _tiles_usable(module, "amx_selftest", "amx_enable", "AMX-INT8", "int8 layers use the vector dot products"):
        return False
    logger.info("AMX-INT8 tiles: self-test passed in a child process; int8 steps of 16+ rows use them")
    return True


def disable_amx() -> None:
    """Back to the vector dot products in this process (tests compare the two paths)."""
    module = load()
    if module is not None:
        module.amx_enable(False)
    amx_enabled.cache_clear()


def quant_linear_bf16_i8(x, packed, fmt, out_features: int, bias=None):
    """x @ W^T with x and W (from `pack_i8`) rounded to bfloat16, float32 sums, through AMX-BF16
    tiles (`amx_bf16_enabled()` first): the int8 mode's path for prompt rows. A row's result does
    not depend on the other rows (the same bits alone or in a batch)."""
    x = x.contiguous()
    out = _module().quant_linear_bf16_i8(x, packed, fmt.code, out_features)
    if bias is not None:
        out += bias
    return out


@functools.cache
def amx_bf16_enabled() -> bool:
    """Whether the int8 mode's prompt rows go through AMX-BF16 tiles (`quant_linear_bf16_i8`):
    built with them (an AVX-512 build on a CPU that lists AMX-BF16), not turned off
    (OCTAVO_AMX_BF16=0), and a forked child's self-test ran the instructions and got the right
    products (a CPU or hypervisor can list AMX and fault on it). Decided once per process."""
    module = load()
    if module is None or not module.amx_bf16_built() or os.environ.get("OCTAVO_AMX_BF16", "1") == "0":
        return False
    return _tiles_usable(module, "amx_bf16_selftest", "amx_bf16_enable", "AMX-BF16", "prompt rows use the int8 dot products")


def quant_vnni() -> bool:
    """Whether the int8-activation kernels use VNNI dot products here (else vpmaddubsw pairs)."""
    module = load()
    return module is not None and module.quant_vnni()


def dequantize_transposed(packed, fmt, in_features: int, out_features: int):
    """W^T as float32 [in_features, out_features] (a view of a padded buffer), each weight bit for
    bit as `octavo.quantization.dequantize` rebuilds it."""
    import torch

    width = packed.shape[0] * _module().pack_width()
    out = torch.empty((in_features, width), dtype=torch.float32)
    _module().dequantize_transposed(out, packed, fmt.code)
    return out[:, :out_features]


def dequantize_rows(packed, fmt, rows, in_features: int, out_features: int):
    """Rows `rows` of a packed W as float32 [len(rows), in_features], bit for bit as
    `octavo.quantization.dequantize` rebuilds them (the embedding lookup)."""
    import torch

    rows = rows.to(torch.long).contiguous()
    out = torch.empty((rows.shape[0], in_features), dtype=torch.float32)
    _module().dequantize_rows(out, packed, fmt.code, rows, out_features)
    return out


def rms_norm(x, weight, eps: float):
    """Same contract as `octavo.kernels.reference.rms_norm`; float32 [n, dim]."""
    return _module().rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    """Same contract as `octavo.kernels.reference.add_rms_norm`, in place on contiguous float32."""
    _module().add_rms_norm(x, residual, weight, eps)
    return x, residual


@functools.cache
def _no_weight():
    """The empty tensor the kernels read as "no weight" (made once: torch.empty costs microseconds)."""
    import torch

    return torch.empty(0)


def rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads: int, num_kv_heads: int,
                    qk_norm=None):
    """Same contract as `octavo.kernels.reference.rotary_write_kv`; float32, contiguous qkv; a cache
    in any of kernels/kv_format.py's dtypes (int8 rows quantized as kv_format.quantize_rows does)."""
    q_w, k_w, eps = qk_norm if qk_norm is not None else (_no_weight(), _no_weight(), 0.0)
    _module().rotary_write_kv(qkv, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slot_mapping, num_heads,
                              num_kv_heads, q_w, k_w, eps)


def silu_and_mul(gate_up):
    """Same contract as `octavo.kernels.reference.silu_and_mul`; float32 [n, 2 * inter]."""
    return _module().silu_and_mul(gate_up.contiguous())


def moe_experts(gate_up, down, fmt_gate_up, fmt_down, hidden: int, inter: int, int8: bool):
    """A layer's experts for moe.cpp: gate_up[e], down[e] packed (by `pack_i8` when `int8`, else
    `pack`), one format per projection. `.forward(x, ids, weights)` has the contract of
    `octavo.kernels.reference.moe_experts` on float32 x and contiguous ids / weights."""
    return _module().MoeExperts(gate_up, down, fmt_gate_up.code, fmt_down.code, hidden, inter, int8)


def quant_isa() -> str | None:
    """The vector instructions the quantized kernels use here (avx512, avx2, scalar), or None."""
    module = load()
    return None if module is None else module.quant_isa()


# Query tokens per work item on multi-token spans: 16 tokens x all heads share each key block
# while it is in L1. Chosen, not tuned: other tile sizes have not been measured.
Q_TILE = 16


def q_tile(num_tokens: int, num_threads: int) -> int:
    """Query tokens per work item: Q_TILE, or fewer when a step has too few tokens to give every
    thread an item (a speculative step of one request verifying 4 drafts is 5 tokens: tiles of 3
    and 2 keep both cores of this machine busy, where one tile of 5 left one idle; docs/BENCHMARKS.md)."""
    return max(1, min(Q_TILE, -(-num_tokens // max(1, num_threads))))


def paged_attention(q, k_cache, v_cache, meta, scale: float, window: int | None = None, softcap: float | None = None,
                    sinks=None, split_kv_heads: bool | None = None):
    """Same contract as `octavo.kernels.reference.paged_attention`; float32 queries, a cache in any
    of kernels/kv_format.py's dtypes (read in place).
    `split_kv_heads`: a work item per (query tile, KV head) rather than per query tile; None: where
    the step has fewer tiles than twice the threads (one user's decode then keeps every thread
    busy). The output's bits do not depend on it."""
    import torch

    module = load()
    if module is None:
        raise RuntimeError("Octavo's CPU kernels could not be built on this machine (see the log)")
    return module.paged_attention(  # [num_tokens, num_heads, head_dim]
        q.contiguous(), k_cache, v_cache, meta.block_tables, meta.query_starts, meta.query_lens, meta.context_lens,
        scale, q_tile(q.shape[0], torch.get_num_threads()),
        0 if window is None else window, 0.0 if softcap is None else softcap,
        None if sinks is None else sinks.float().contiguous(), -1 if split_kv_heads is None else int(split_kv_heads),
    )
