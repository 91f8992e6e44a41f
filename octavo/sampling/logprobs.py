"""TokenLogprob: what the sampler reports about one sampled (or prompt) token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob and the top-k alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float]
