"""BeamGroup: the beam-search decisions of one request, in pure Python (the Scheduler applies them).

The beams of a request are ordinary sequences that share KV blocks. Each round, every live beam
hands in its 2 x beam_width most likely next tokens with their logprobs; once all have, `advance`
picks the round's continuations exactly as transformers' beam search does (`_beam_search` in
transformers 5: top 2W of cumulative logprobs over all beams; a candidate that ends (EOS, or the
last allowed token) becomes a finished hypothesis if it ranks in the top W, scored
cum_logprob / generated_len ** length_penalty; the best W that do not end keep running; the
early-stopping rule decides when to stop). The scheduler then forks the beams chosen more than
once, drops the beams not chosen, and appends each continuation's token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.sampling.params import BeamSearchParams

_ENDED = -1.0e9  # transformers' score offset for candidates that hit a stopping criterion


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (the EOS included when it ended on one)."""

    token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    ended_on_eos: bool


@dataclass(slots=True)
class Continuation:
    parent_id: str
    token_id: int
    cum_logprob: float


@dataclass(slots=True)
class Round:
    """One `advance`: the beams to keep running (by parent; a parent listed k times forks k - 1
    times) and the beams to drop; `done` means the search is over (every beam is dropped)."""

    continuations: list[Continuation]
    dropped: list[str]
    done: bool


@dataclass(slots=True)
class BeamGroup:
    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    running: dict[str, float] = field(default_factory=dict)  # live beam id -> cumulative logprob
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # this round's
    finished: list[Hypothesis] = field(default_factory=list)  # at most beam_width, best first
    num_generated: int = 0  # tokens each live beam has generated (all advance together)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False
    next_beam_index: int = 1  # for unique ids of forked beams

    @property
    def width(self) -> int:
        return self.params.beam_width

    def start(self, beam_id: str) -> None:
        self.running = {beam_id: 0.0}

    def new_beam_id(self, user_request_id: str) -> str:
        beam_id = f"{user_request_id}#beam{self.next_beam_index}"
        self.next_beam_index += 1
        return beam_id

    def add_candidates(self, beam_id: str, top: dict[int, float]) -> None:
        """A live beam's most likely next tokens (token id -> logprob) for this round."""
        if beam_id not in self.running:
            raise ValueError(f"{beam_id} is not a live beam of this group")
        self.candidates[beam_id] = sorted(top.items(), key=lambda kv: -kv[1])

    def forget(self, beam_id: str) -> None:
        """A beam recomputed from scratch (preempted) hands its candidates in again."""
        self.candidates.pop(beam_id, None)

    @property
    def is_ready(self) -> bool:
        return not self.done and bool(self.running) and all(b in self.candidates for b in self.running)

    def _ends(self, token: int) -> bool:
        if self.num_generated + 1 >= self.params.max_tokens:
            return True
        return not self.params.ignore_eos and token in self.eos_token_ids

    def advance(self, tokens_of: dict[str, list[int]]) -> Round:
        """Decide this round from every live beam's candidates. `tokens_of[beam]`: the beam's
        generated tokens so far (to build finished hypotheses). Mutates the group."""
        if not self.is_ready:
            raise ValueError("advance needs candidates from every live beam")
        k = 2 * self.width
        pool = sorted(
            ((cum + lp, beam, tok) for beam, cum in self.running.items() for tok, lp in self.candidates[beam]),
            key=lambda c: -c[0],
        )[:k]
        ends = [self._ends(tok) for _, _, tok in pool]
        self._add_finished(pool, ends, tokens_of)
        ranked = sorted(range(len(pool)), key=lambda i: -(pool[i][0] + (_ENDED if ends[i] else 0.0)))[: self.width]
        keep = [Continuation(pool[i][1], pool[i][2], pool[i][0]) for i in ranked if not ends[i]]
        self.num_generated += 1
        self.candidates.clear()
        best_running = keep[0].cum_logprob if keep else None
        self._update_improvable(best_running)
        all_full = len(self.finished) == self.width and self.params.early_stopping is True
        self.done = not keep or all(ends) or not self.improvable or all_full
        parents = set(self.running)
        if self.done:
            keep = []
        self.running = {}
        return Round(keep, sorted(parents - {c.parent_id for c in keep}), self.done)

    def _add_finished(self, pool: list[tuple[float, str, int]], ends: list[bool], tokens_of: dict[str, list[int]]) -> None:
        blocked = not self.improvable or (len(self.finished) == self.width and self.params.early_stopping is True)
        if blocked:
            return
        length = (self.num_generated + 1) ** self.params.length_penalty
        for rank, ((cum, beam, tok), ended) in enumerate(zip(pool, ends)):
            if rank >= self.width or not ended:
                continue
            eos = not self.params.ignore_eos and tok in self.eos_token_ids
            self.finished.append(Hypothesis(tokens_of[beam] + [tok], cum, cum / length, eos))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

    def _update_improvable(self, best_running_cum: float | None) -> None:
        """transformers' heuristic: can the best running beam still beat the worst finished one?"""
        if len(self.finished) < self.width or best_running_cum is None:
            return
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            best_len = self.params.max_tokens
        else:
            best_len = self.num_generated
        best_possible = best_running_cum / (best_len**self.params.length_penalty)
        if not best_possible > min(h.score for h in self.finished):
            self.improvable = False

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (at most beam_width)."""
        return list(self.finished)
