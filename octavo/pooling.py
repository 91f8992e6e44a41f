"""An embedding from pooled hidden states: mean division, Matryoshka truncation, normalisation
(pure Python: the scheduler finishes embedding requests with it)."""

from __future__ import annotations

import math

from octavo.sampling.params import PoolingParams


def finish_embedding(pooled: list[float], num_tokens: int, params: PoolingParams) -> list[float]:
    """The embedding of a prompt of `num_tokens` from its pooled states (`pooled`: the sum of every
    position's state for "mean", the one state otherwise)."""
    values = [v / num_tokens for v in pooled] if params.pooling_type == "mean" else list(pooled)
    if params.dimensions is not None:
        values = values[: params.dimensions]
    if params.normalize:
        norm = math.sqrt(sum(v * v for v in values))
        if norm > 0:
            values = [v / norm for v in values]
    return values
