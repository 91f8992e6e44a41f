"""Octavo: an LLM serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.sampling.params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from octavo.engine import LLMEngine
    from octavo.llm import LLM

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-backed classes load on first use, so the pure-Python modules import without torch.
    if name == "LLM":
        from octavo.llm import LLM

        return LLM
    if name == "LLMEngine":
        from octavo.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
