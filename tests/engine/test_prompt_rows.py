"""Which rows of a step the int8 mode sends through the AMX-BF16 tiles (ModelRunner._prompt_rows, by kernels/row_paths.py):
the prompt positions of requests whose prompts have PROMPT_TILES_MIN_TOKENS or more, decided by
each request alone (its prompt length and positions), never by what else shares the step."""

from __future__ import annotations

from octavo.kernels.row_paths import PROMPT_TILES_MIN_TOKENS as T
from octavo.model_runner import ModelRunner
from octavo.outputs import ScheduledRequest
from octavo.sampling.params import SamplingParams


def entry(rid: str, prompt_len: int, start: int, n: int) -> ScheduledRequest:
    prompt = list(range(prompt_len))
    return ScheduledRequest(rid, [7] * n, start, [[0]], SamplingParams(), [], prompt)


def rows(entries):
    starts, at = [], 0
    for e in entries:
        starts.append(at)
        at += e.num_tokens
    got = ModelRunner._prompt_rows(entries, starts, at)
    if got is None:
        return None, None
    return got.rows.tolist(), None if got.other is None else got.other.tolist()


def test_a_long_prompts_chunk_alone_is_every_row():
    assert rows([entry("a", T + 40, 0, 32)]) == (list(range(32)), None)


def test_decodes_short_prompts_and_generated_positions_stay_int8():
    steps = [
        entry("decode", T + 10, T + 12, 1),  # past its prompt: a generated position
        entry("short", T - 1, 0, T - 1),  # a whole prompt, shorter than T
        entry("long", 2 * T, T + 10, 40),  # its prompt's last 54 positions ... of which 40 now
        entry("recompute", T, T - 3, 8),  # 3 prompt positions, then 5 generated ones (after preemption)
    ]
    got, other = rows(steps)
    long_first = 1 + (T - 1)
    recompute_first = long_first + 40
    assert got == list(range(long_first, long_first + 40)) + list(range(recompute_first, recompute_first + 3))
    assert other == [0, *range(1, long_first), *range(recompute_first + 3, recompute_first + 8)]


def test_a_requests_rows_do_not_depend_on_its_neighbours():
    alone, _ = rows([entry("x", T + 5, 0, T + 5)])
    with_others, _ = rows([entry("d", 3, 3, 1), entry("x", T + 5, 0, T + 5)])
    assert [r - 1 for r in with_others] == alone


def test_no_prompt_rows_is_none():
    assert rows([entry("d", T + 1, T + 1, 1), entry("s", 5, 0, 5)]) == (None, None)
