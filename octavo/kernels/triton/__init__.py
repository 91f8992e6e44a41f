"""Triton kernels, one file each, selected only through octavo.kernels.dispatch (GPU issue)."""
