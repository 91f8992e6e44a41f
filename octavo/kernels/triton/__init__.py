"""Triton kernels, one file each, selected only through octavo.kernels.dispatch (models never import them).

They run on NVIDIA GPUs, and on the CPU only under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is first imported), which the tests use with small shapes.
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def is_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def is_interpreted() -> bool:
    """True when Triton kernels run in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_run_on(device_type: str) -> bool:
    """Whether Triton kernels can run on tensors of this device type here."""
    if not is_installed():
        return False
    if is_interpreted():
        return device_type == "cpu"
    return device_type == "cuda"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
