"""The one place that picks a kernel implementation: torch reference on CPU, Triton on GPU (later)."""

from __future__ import annotations

from octavo.kernels import reference

# Until the Triton kernels land (GPU issue) every device runs the reference implementations.
rms_norm = reference.rms_norm
apply_rotary = reference.apply_rotary
silu_and_mul = reference.silu_and_mul
write_kv = reference.write_kv
paged_attention = reference.paged_attention
copy_blocks = reference.copy_blocks
