"""Simulator workloads: random lengths, shared-prefix mixes, or a JSON trace; pure Python, seeded."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

VOCAB = 49152


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    priority: int = 0
    cold: bool = False  # shares no prefix with any other request (reported apart: do they starve?)
    prompt_text: str | None = None  # a text prompt (sent as text; prompt_token_ids is then empty)


def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """All at 0 for an infinite rate; else gamma-distributed gaps with mean 1/rate (Poisson at 1)."""
    if rate == float("inf"):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def random_workload(
    num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
    rate: float = float("inf"), burstiness: float = 1.0,
) -> list[SimRequest]:
    """Lengths uniform in [len x (1 - range_ratio), len x (1 + range_ratio)]; random token ids."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    arrivals = _arrivals(num_requests, rate, burstiness, rng)
    out = []
    for t in arrivals:
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio))))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        out.append(SimRequest(t, tuple(rng.randrange(VOCAB) for _ in range(n_in)), n_out))
    return out


def shared_prefix_workload(
    num_requests: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int, seed: int = 0,
    rate: float = float("inf"), burstiness: float = 1.0, cold_fraction: float = 0.0,
) -> list[SimRequest]:
    """Each request: one of `num_prefixes` shared prefixes (round robin) + its own random suffix;
    a `cold_fraction` of them (spread evenly) has a prefix of its own instead (same lengths)."""
    if not 0.0 <= cold_fraction <= 1.0:
        raise ValueError(f"the cold fraction must be in [0, 1], got {cold_fraction}")
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
    arrivals = _arrivals(num_requests, rate, burstiness, rng)
    out, num_warm = [], 0
    for i, t in enumerate(arrivals):
        cold = int((i + 1) * cold_fraction) > int(i * cold_fraction)
        prefix = tokens(prefix_len) if cold else prefixes[num_warm % num_prefixes]
        num_warm += not cold
        out.append(SimRequest(t, prefix + tokens(suffix_len), output_len, cold=cold))
    return out


_NAMES = ("total", "count", "items", "value", "result", "index", "buffer", "offset", "limit", "scale", "name",
          "width", "height", "score", "weight", "record", "entry", "table", "queue", "cache")
_OPS = ("+", "-", "*", "//", "%")


def _function(rng: random.Random, number: int) -> str:
    """A small Python function with made-up names: something to copy and edit."""
    args = rng.sample(_NAMES, 3)
    lines = [f"def {rng.choice(_NAMES)}_{number}({', '.join(args)}):", f'    """Combine {args[0]} with {args[1]}."""']
    local = args[:]
    for i in range(rng.randint(3, 6)):
        new = f"{rng.choice(_NAMES)}_{i}"
        lines.append(f"    {new} = {rng.choice(local)} {rng.choice(_OPS)} {rng.choice(local + [str(rng.randint(1, 99))])}")
        if rng.random() < 0.3:
            lines.append(f"    if {new} > {rng.randint(0, 50)}:\n        {new} = {rng.choice(local)}")
        local.append(new)
    lines.append(f"    return {local[-1]}")
    return "\n".join(lines)


def code_edit_workload(
    num_requests: int, output_len: int, seed: int = 0, num_functions: int = 4,
    rate: float = float("inf"), burstiness: float = 1.0,
) -> list[SimRequest]:
    """Text prompts whose answer copies most of the prompt: a few made-up Python functions, then
    the request to write them again with one name changed (the code-repeat / edit case that
    drafting from the prompt serves)."""
    rng = random.Random(seed)
    arrivals = _arrivals(num_requests, rate, burstiness, rng)
    out = []
    for t in arrivals:
        code = "\n\n\n".join(_function(rng, i) for i in range(num_functions))
        old = code.split("(", 1)[1].split(",", 1)[0]
        text = (f"```python\n{code}\n```\n\nThe same code, with the parameter `{old}` renamed to `{old}_new` "
                f"everywhere and nothing else changed:\n\n```python\n")
        out.append(SimRequest(t, (), output_len, prompt_text=text))
    return out


def trace_workload(path: str | Path) -> list[SimRequest]:
    """A JSON list (or {"requests": [...]}) of entries with prompt_token_ids or prompt_len, max_tokens
    or output_len, and optionally arrival_time (seconds; default 0) and priority (lower first)."""
    data = json.loads(Path(path).read_text())
    entries = data["requests"] if isinstance(data, dict) else data
    out = []
    for i, e in enumerate(entries):
        if "prompt_token_ids" in e:
            prompt = tuple(int(t) for t in e["prompt_token_ids"])
        elif "prompt_len" in e:
            prompt = tuple((i * 7919 + j) % VOCAB for j in range(int(e["prompt_len"])))  # distinct per request
        else:
            raise ValueError(f"trace entry {i} needs prompt_token_ids or prompt_len")
        n_out = e.get("max_tokens", e.get("output_len"))
        if n_out is None:
            raise ValueError(f"trace entry {i} needs max_tokens or output_len")
        out.append(SimRequest(float(e.get("arrival_time", 0.0)), prompt, int(n_out), int(e.get("priority", 0))))
    return out


def multi_turn_workload(
    num_conversations: int, num_turns: int, system_len: int, user_len: int, answer_len: int, seed: int = 0,
) -> list[list[SimRequest]]:
    """Chat conversations whose every turn resends the whole history, as chat clients do: turn k's
    prompt is the conversation's own system prompt, then each earlier user message and answer,
    then the new user message. The answers are `answer_len` random tokens standing for the model's
    (a client would resend what it received; these make every server do the same work). Returns
    one list of turns per conversation; arrival times are 0 (the client paces the turns)."""
    if min(num_conversations, num_turns, system_len, user_len, answer_len) < 1:
        raise ValueError("multi-turn: conversations, turns and every length must be >= 1")
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    out = []
    for _ in range(num_conversations):
        history = tokens(system_len)
        turns = []
        for _ in range(num_turns):
            history += tokens(user_len)
            turns.append(SimRequest(0.0, history, answer_len))
            history += tokens(answer_len)
        out.append(turns)
    return out
