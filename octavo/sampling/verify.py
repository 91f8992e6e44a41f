"""Speculative decoding's verification: which of a sequence's drafts its own samples agree with.

A sequence with k drafts samples at its last k + 1 positions, row j as if drafts[:j] were its
output (penalties, grammar rows and its seeded generator in order), so row j's token is exactly
what plain decoding would sample there once drafts[:j] were accepted. It keeps the drafts up to
the first that differs from its row's sample, then that sample (greedy: argmax; sampled: the
rejection rule for a point-mass draft). A seeded generator is rewound to its state after the last
kept row's draw, so seeded output does not depend on the drafts. Pure Python over the sampler's
outputs: the runner calls it, tests/sampling hold it to plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from octavo.sampling.logprobs import TokenLogprob


def draft_outputs(output_token_ids: list[int], drafts: list[int]) -> list[list[int]]:
    """The output each of a sequence's k + 1 sampling rows samples after: row j's is its output
    followed by its first j drafts."""
    return [output_token_ids + drafts[:j] if j else output_token_ids for j in range(len(drafts) + 1)]


@dataclass(slots=True)
class Verified:
    """A sequence's step: the tokens it keeps (agreed drafts, then one sample), their logprobs
    where asked, and the sampling row whose generator state its generator takes (None: the last
    row's, as drawn)."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    rewind_row: int | None


def verify(seq_ids: list[str], tokens: list[int], logprobs: list[TokenLogprob | None],
           drafts: dict[str, list[int]]) -> dict[str, Verified]:
    """Per sequence, what its rows' samples keep. `seq_ids`, `tokens`, `logprobs`: one entry per
    sampling row, a sequence's k + 1 rows consecutive (k = len(drafts.get(seq, [])))."""
    out: dict[str, Verified] = {}
    i = 0
    while i < len(seq_ids):
        sid = seq_ids[i]
        ahead = drafts.get(sid, [])
        num_kept = 1
        while num_kept <= len(ahead) and tokens[i + num_kept - 1] == ahead[num_kept - 1]:
            num_kept += 1  # draft j agreed with row j's sample: row j + 1 samples after it
        kept_logprobs = logprobs[i : i + num_kept] if logprobs[i] is not None else None
        rewind = i + num_kept - 1 if num_kept <= len(ahead) else None
        out[sid] = Verified(tokens[i : i + num_kept], kept_logprobs, rewind)
        i += len(ahead) + 1
    return out
