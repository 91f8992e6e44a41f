"""SamplingParams: how one request's tokens are chosen and when it stops; validated, pure Python."""

from __future__ import annotations

from dataclasses import dataclass

_GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ValueError naming the field and the range.

    temperature 0 is greedy. top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs.
    `seed` makes the request's random choices reproducible whatever else is in the batch.
    `logprobs=k` returns the sampled token's logprob and the k most likely tokens at each step.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the tuple fields; store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or None")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "must be an integer in [0, 20] or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
