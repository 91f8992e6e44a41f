"""Sampling: the per-request parameters (pure Python) and the sampler (torch)."""

from octavo.sampling.params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
