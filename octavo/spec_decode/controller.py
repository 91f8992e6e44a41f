"""SpecDecodeController: speculative decoding's one owner (proposers, draft lengths, per-request
drafting state, the grammar filter, the counters). Pure Python.

Each step the engine asks it for drafts before scheduling (`propose`), the scheduler schedules
them after the request's last token and rolls back what the runner refused, and the engine
reports the step's verifications back (`observe`). A proposer is anything with
`propose([(request, max drafts)]) -> {request id: drafts}` and `finish(request)`: prompt lookup
(n-gram), a suffix tree over recent requests, or a draft model (spec_decode/draft_model.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from octavo.config import SpeculativeConfig
from octavo.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodeStats
from octavo.request import Request
from octavo.spec_decode.ngram import NgramDrafter
from octavo.spec_decode.suffix import SuffixDrafter


class Proposer(Protocol):
    def propose(self, candidates: list[tuple[Request, int]]) -> dict[str, list[int]]: ...

    def finish(self, request: Request) -> None: ...


class TokenProposer:
    """A proposer of one request at a time from its tokens (n-gram, suffix) as a Proposer."""

    def __init__(self, drafter: NgramDrafter | SuffixDrafter) -> None:
        self.drafter = drafter

    def propose(self, candidates: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {r.request_id: self.drafter.propose(r.request_id, r.all_token_ids, n) for r, n in candidates}

    def finish(self, request: Request) -> None:
        self.drafter.finish(request.request_id, request.all_token_ids)


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    """The proposer of a pure-Python `--speculative-method` (ngram: prompt lookup; suffix: a tree
    over this and recent requests). "draft" needs its model loaded: the engine builds it."""
    if spec.method == "ngram":
        return TokenProposer(NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max))
    if spec.method == "suffix":
        return TokenProposer(SuffixDrafter(max_depth=max(spec.prompt_lookup_max, 8)))
    raise ValueError(f"speculative method {spec.method!r} has no pure-Python proposer")


def best_num_drafts(acceptance: float, draft_cost: float, max_drafts: int) -> int:
    """The draft length (1..max_drafts) that makes the most tokens per unit of step cost, when
    each draft is kept with probability `acceptance` if the ones before it were (so k drafts
    yield (1 - a^(k+1)) / (1 - a) tokens) and each costs `draft_cost` of a decode step."""
    best, best_rate = 1, 0.0
    for k in range(1, max_drafts + 1):
        tokens = k + 1 if acceptance >= 1.0 else (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)
        rate = tokens / (1.0 + draft_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(slots=True)
class DraftState:
    """One request's drafting record: drafts kept and verifications that refused one (decayed:
    its acceptance rate), and the back-off after verifications that kept nothing."""

    kept: float = 0.0
    rejected: float = 0.0
    backoff: int = 0
    resume_step: int = 0  # no drafts before this step


class SpecDecodeController:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, max_num_batched_tokens: int,
                 proposer: Proposer, grammar_filter: Callable[[Request, list[int]], list[int]] | None = None) -> None:
        """`grammar_filter(request, drafts)`: the prefix of the drafts a request may verify (its
        structured-output grammar's), or None."""
        self.spec = spec
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = proposer
        self.grammar_filter = grammar_filter
        self.states: dict[str, DraftState] = {}
        self.stats = SpecDecodeStats(acceptance_counts=[0] * (spec.num_speculative_tokens + 1))
        self._num_steps = 0

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Before a step: the drafts each running request may verify in it (`draft_limit` of them
        at most, cut where its grammar would refuse them); requests without drafts are left out.
        The step's budget may cut them further (the scheduler)."""
        self._num_steps += 1
        num_decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        candidates = [(r, n) for r in running if (n := self.draft_limit(r, num_decoding)) > 0]
        drafts = self.proposer.propose(candidates) if candidates else {}
        by_id = {r.request_id: r for r, _ in candidates}
        if self.grammar_filter is not None:
            drafts = {rid: self.grammar_filter(by_id[rid], d) if d else d for rid, d in drafts.items()}
        return {rid: d for rid, d in drafts.items() if d}

    def draft_limit(self, request: Request, num_decoding: int) -> int:
        """The most drafts a request may verify in the coming step: as many as pay for their cost
        at its acceptance rate so far (`best_num_drafts`); none for a prompt chunk, a beam, a
        request about to fork, while it backs off, while more than `max_batch` requests decode,
        or past max_tokens, max_model_len or the step's budget."""
        spec = self.spec
        state = self.states.get(request.request_id) or DraftState()
        if (request.num_tokens - request.num_computed_tokens != 1 or not request.output_token_ids
                or request.beam is not None or request.num_samples_pending > 1
                or self._num_steps < state.resume_step or num_decoding > spec.max_batch):
            return 0
        acceptance = (state.kept + 1.0) / (state.kept + state.rejected + 2.0)
        draft_cost = num_decoding / (num_decoding + spec.draft_cost_batch)
        limit = min(best_num_drafts(acceptance, draft_cost, spec.num_speculative_tokens),
                    self.max_num_batched_tokens - 1, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return max(0, limit)

    def observe(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """After a step: each verification the runner did (drafts scheduled, how many it agreed
        with) counts, and moves its request's acceptance rate and back-off."""
        for entry in output.scheduled:
            drafts = entry.samples[0].draft_token_ids if entry.samples else []
            rid = entry.request_id
            if not drafts or rid not in result.tokens:
                continue  # no drafts, or left out of the step
            num_accepted = len(result.tokens[rid]) - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(drafts)
            self.stats.num_accepted_tokens += num_accepted
            self.stats.acceptance_counts[num_accepted] += 1
            state = self.states.setdefault(rid, DraftState())
            state.kept = 0.8 * state.kept + num_accepted
            state.rejected = 0.8 * state.rejected + (num_accepted < len(drafts))
            if num_accepted:
                state.backoff = 0
            else:  # nothing agreed: draft again after 1, 2, 4, ... steps
                state.backoff = min(max(1, 2 * state.backoff), self.spec.max_backoff_steps)
                state.resume_step = self._num_steps + 1 + state.backoff

    def finish(self, requests: list[Request]) -> None:
        """Requests that ended: their state is dropped (a suffix tree learns their tokens)."""
        for request in requests:
            self.states.pop(request.request_id, None)
            self.proposer.finish(request)
