"""Compute kernels: torch references (the CPU path and the test oracle) and, later, Triton versions."""
