"""Compiles the C++ CPU kernels into the cache so that no start can wedge another: one builder at a
time (a flock that dies with its holder), the compile in a child process that a stopped start
takes down with it, into a temporary folder renamed into place; the folder's name is a key of the
sources, flags, torch, Python and CPU, so checkouts and machines never build over each other.

`python -m octavo.kernels.cpu.build SRC OUT FLAGS_JSON` is the child: it compiles SRC's sources
into OUT with torch's extension builder and exits.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from octavo.cache import cache_dir, exclusive, move_into_place, remove_leftovers, temporary_folder, wait_timeout_s
from octavo.cpu_features import cpu_flags_line

logger = logging.getLogger("octavo.kernels.cpu")

MODULE_NAME = "octavo_cpu_kernels"
_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in (
    "bindings.cpp", "layer_ops.cpp", "paged_attention.cpp", "quant_linear.cpp", "quant_linear_kq.cpp",
    "quant_linear_i8.cpp", "moe.cpp"))
# Only bindings.cpp includes torch's Python bindings (<torch/python.h>); the kernels include ATen's
# tensor and parallel headers alone: <torch/extension.h> cost ~20 s of compile per file, and the
# first start compiled in 56 s rather than 23 s here (two cores).
HEADERS = tuple(_HERE / name for name in ("vec_math.h", "kv_store.h", "quant_isa.h", "packing.h", "quant_linear_kq.h", "moe.h"))  # compiled through the sources; part of the key
# -march=native: the build is cached per machine (the key includes the CPU flags), so it may use
# whatever vector units this CPU has (AVX-512, AVX2 or neither: the kernels pick at compile time).
# -fopenmp: at::parallel_for is an OpenMP region in the header; the library resolves to the
# libgomp torch already loaded. -ffp-contract=off: the quantized kernels rebuild each weight as
# d * q + m with two roundings, as gguf-py does; a fused multiply-add would round once.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]
# OCTAVO_CPU_ISA narrows what the build may use, to test the other code paths on a bigger CPU:
# "avx2" (no AVX-512), "avx2-novnni" (nor AVX-VNNI) or "generic" (no AVX2, FMA or F16C: the plain C++ paths). Default "native".
ISA_FLAGS = {
    "native": [],
    "avx2": ["-mno-avx512f"],
    "avx2-novnni": ["-mno-avx512f", "-mno-avxvnni"],  # the int8 kernels' vpmaddubsw fallback
    "generic": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"],
}


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled here; the message carries the compiler's last words."""


def cflags() -> list[str]:
    isa = os.environ.get("OCTAVO_CPU_ISA", "native")
    if isa not in ISA_FLAGS:
        raise ValueError(f"OCTAVO_CPU_ISA must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return CFLAGS + ISA_FLAGS[isa]


def build_dir() -> Path:
    """Where the build lives: keyed by the sources, the flags, torch, Python and the CPU."""
    import torch

    key = hashlib.sha256("\n".join([
        *(s.read_text() for s in SOURCES + HEADERS), " ".join(cflags()), torch.__version__,
        platform.python_version(), cpu_flags_line(),
    ]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu-{key}"


def library_path(directory: Path) -> Path:
    return directory / f"{MODULE_NAME}.so"


def ensure_built(timeout_s: float | None = None) -> Path:
    """The compiled library's path, compiling it first if no process has (KernelBuildError if it
    cannot be built; CacheWaitTimeout if another process's build outlasts `timeout_s`, default
    `octavo.cache.wait_timeout_s()`). Safe to call from many processes at once, and to kill at
    any point: the next call finds either the finished library or nothing, never half of one."""
    timeout_s = wait_timeout_s() if timeout_s is None else timeout_s
    final = build_dir()
    library = library_path(final)
    if library.is_file():
        return library
    deadline = time.monotonic() + timeout_s
    with exclusive(final.with_name(final.name + ".lock"), f"the CPU kernel build into {final}", timeout_s):
        if library.is_file():  # another process built it while this one waited
            return library
        prefix = f".build-{final.name}-"
        remove_leftovers(final.parent, prefix)
        work = temporary_folder(final.parent, prefix)
        try:
            logger.info("compiling Octavo's CPU kernels for this CPU (once per machine and version, ~25 s) into %s", final)
            start = time.monotonic()
            _compile_in_child(work, max(1.0, deadline - time.monotonic()))
            move_into_place(work / "out", final)
            logger.info("CPU kernels compiled in %.0f s", time.monotonic() - start)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return library


def _compile_in_child(work: Path, timeout_s: float) -> None:
    """Copy the sources into `work/src` and compile them into `work/out` in a child process (its
    own process group, which is killed on timeout, on an exception here such as Ctrl-C, and, through
    PR_SET_PDEATHSIG, when this thread dies with its process)."""
    src = work / "src"
    src.mkdir()
    for path in SOURCES + HEADERS:
        shutil.copy2(path, src / path.name)
    (work / "out").mkdir()
    cmd = [sys.executable, "-m", "octavo.kernels.cpu.build", str(src), str(work / "out"), json.dumps(cflags()),
           str(os.getpid())]
    log = work / "build.log"
    with open(log, "wb") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise KernelBuildError(f"the compile did not finish in {timeout_s:.0f} s (OCTAVO_CACHE_WAIT_TIMEOUT sets "
                                   f"the limit); its log: {_tail(log)}") from None
        finally:
            if child.poll() is None:
                _stop_group(child)
    if returncode != 0:
        raise KernelBuildError(f"the compiler failed (exit status {returncode}): {_tail(log)}")


def _die_with_parent(parent_pid: int) -> None:
    """In the child: be sent SIGTERM when the thread that started it dies (its process killed, even
    by SIGKILL), and exit now if that already happened. Linux only; elsewhere a killed parent's
    compile runs to its end (into a folder the next builder removes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        sys.exit(1)


def _stop_group(child: subprocess.Popen) -> None:
    """Stop the compile: SIGTERM to the child's group (ninja, on SIGTERM, stops the compilers it
    started in groups of their own), SIGKILL what is left after 5 s."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(log: Path, num_chars: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-num_chars:].strip() or "(empty)"
    except OSError:
        return "(no log)"


def _stop_compile(signum: int, frame: object) -> None:
    """The child's SIGTERM (from its parent's death or `_stop_group`): pass it to ninja, in this
    process's group, which stops its compilers; then leave."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgid(0), signal.SIGTERM)
    os._exit(1)


def _child_main(src: str, out: str, flags_json: str, parent_pid: str) -> int:
    signal.signal(signal.SIGTERM, _stop_compile)
    _die_with_parent(int(parent_pid))
    from torch.utils.cpp_extension import load as load_extension

    sources = [str(Path(src) / p.name) for p in SOURCES]
    load_extension(name=MODULE_NAME, sources=sources, extra_cflags=json.loads(flags_json), build_directory=out,
                   verbose=False)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:5]))
