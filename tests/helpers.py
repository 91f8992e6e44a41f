"""Small builders shared by the pure-Python tests."""

from __future__ import annotations

import zlib

from octavo.request import Request
from octavo.beam_search import BeamGroup
from octavo.sampling.params import BeamSearchParams, SamplingParams


def make_request(
    rid: str,
    tokens: list[int] | int,
    max_tokens: int = 8,
    arrival: float = 0.0,
    salt: str | None = None,
    priority: int = 0,
    n: int = 1,
    beam_width: int | None = None,
    eos: tuple[int, ...] = (),
) -> Request:
    if isinstance(tokens, int):
        # distinct prompts per id, so no test gets a prefix hit it did not ask for
        base = 1000 * (1 + zlib.crc32(rid.encode()) % 40)
        prompt = list(range(base, base + tokens))
    else:
        prompt = list(tokens)
    if beam_width is not None:  # a beam search (its sequences run with BeamSearchParams.sequence_params)
        beam = BeamGroup(BeamSearchParams(beam_width, max_tokens=max_tokens), eos)
        return Request(rid, prompt, beam.params.sequence_params(), arrival, eos, priority, salt, beam=beam)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    return Request(
        request_id=rid if n == 1 else f"{rid}#0",
        prompt_token_ids=prompt,
        sampling_params=params,
        arrival_time=arrival,
        cache_salt=salt,
        priority=priority,
        parent_id=None if n == 1 else rid,
        num_samples_pending=n,
    )
