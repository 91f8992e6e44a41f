"""Sampling: the per-request parameters (pure Python) and the sampler (torch)."""

from octavo.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
