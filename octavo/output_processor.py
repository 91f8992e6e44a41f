"""OutputProcessor: what each user request has produced so far, turned into RequestOutputs.

It owns the per-request output state (completions, their incremental detokenizers, logprobs,
beam-search finishes, DELTA bookkeeping) and the stop-string check. It never touches the
scheduler or the grammar matchers: `process` returns, as data, the sequences a stop string ended
(the engine finishes them in the scheduler) and the sequences and requests that are over (the
engine drops their matchers and grammar holds). `merge_deltas` folds DELTA outputs a slow reader
has not taken yet into one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from octavo.beam_search import BeamGroup
from octavo.detokenizer import IncrementalDetokenizer
from octavo.request import CompletionOutput, FinishReason, Request, RequestMetrics, RequestOutput
from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _Completion:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # beam search
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_sent_tokens: int = 0  # DELTA outputs: tokens (and logprobs) already handed out
    reported_finish: bool = False  # DELTA outputs: the finish reason was already handed out


@dataclass(slots=True)
class _RequestState:
    """What is kept per user request to build its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[_Completion]
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    tier_load_wait: float = 0.0
    beam: BeamGroup | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once
    embedding: list[float] | None = None  # an embedding request's, once it has finished

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


@dataclass(slots=True)
class ProcessedOutputs:
    """One step's outputs, and what the engine must apply elsewhere because of them."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stopped_seq_ids: list[str] = field(default_factory=list)  # ended by a stop string: finish them (STOP)
    ended_seq_ids: list[str] = field(default_factory=list)  # sequences over: drop their grammar matchers
    finished_request_ids: list[str] = field(default_factory=list)  # user requests over: release their holds


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float, beam: BeamGroup | None = None) -> None:
        """Start the output state of a request the scheduler has accepted (one completion per
        sample, or per beam of a search)."""
        num = params.n if beam is None else beam.width
        self._states[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            arrival_time=arrival_time,
            completions=[
                _Completion(
                    IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output),
                    logprobs=[] if params.logprobs is not None else None,
                )
                for _ in range(num)
            ],
            beam=beam,
        )

    def abort_request(self, request_id: str) -> None:
        """Forget a request (no output for it follows)."""
        self._states.pop(request_id, None)

    def process(self, changed: list[Request]) -> ProcessedOutputs:
        """Take the sequences the scheduler's update changed (new tokens each, or a finished
        beam search) into their requests' completions; return the outputs of requests that
        changed (finished ones carry finished=True and are forgotten here) and what to apply."""
        result = ProcessedOutputs()
        touched: dict[str, _RequestState] = {}
        for seq in changed:
            state = self._states.get(seq.user_request_id)
            if state is None:
                continue
            if state.beam is not None:
                if state.beam.done and not state.finished:
                    _finish_search(state, seq)
                    touched[state.request_id] = state
                continue
            self._take_token(state, seq, result)
            touched[state.request_id] = state
        for state in touched.values():
            finished = state.finished
            if finished:
                del self._states[state.request_id]
                result.finished_request_ids.append(state.request_id)
            if finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                result.outputs.append(_output(state, finished))
        return result

    @staticmethod
    def _take_token(state: _RequestState, seq: Request, result: ProcessedOutputs) -> None:
        """The sequence's new tokens (and logprobs) into its completion: one, or several when it
        verified drafts; stop strings checked after each (the tokens after a stop are dropped)."""
        if state.prompt_logprobs is None and seq.sampling_params.prompt_logprobs is not None:
            state.prompt_logprobs = [None, *seq.prompt_logprobs]
        if seq.embedding is not None:
            state.embedding = seq.embedding
        comp = state.completions[seq.sample_index]
        for index in range(len(comp.token_ids), seq.num_output_tokens):
            token = seq.output_token_ids[index]
            comp.token_ids.append(token)
            if comp.logprobs is not None and index < len(seq.output_logprobs):
                comp.logprobs.append(seq.output_logprobs[index])
            comp.detokenizer.add_token(token)
            if comp.detokenizer.stop_reason is not None:
                break
        if comp.detokenizer.stop_reason is not None:
            if not seq.is_finished:
                result.stopped_seq_ids.append(seq.request_id)
            comp.finish_reason, comp.stop_reason = FinishReason.STOP.value, comp.detokenizer.stop_reason
            result.ended_seq_ids.append(seq.request_id)
        elif seq.is_finished:
            result.ended_seq_ids.append(seq.request_id)
            comp.finish_reason = seq.finish_reason.value
            if seq.finish_reason is FinishReason.STOP and comp.token_ids and comp.token_ids[-1] in seq.sampling_params.stop_token_ids:
                comp.stop_reason = comp.token_ids[-1]
        if state.first_token_time is None:
            state.first_token_time = seq.first_token_time
            state.first_scheduled_time = seq.first_scheduled_time
            state.num_cached_tokens = seq.num_cached_tokens or 0
        state.num_preemptions = max(state.num_preemptions, seq.num_preemptions)
        state.tier_load_wait = max(state.tier_load_wait, seq.tier_load_wait)


def _finish_search(state: _RequestState, seq: Request) -> None:
    """A beam search is over: its completions become the best hypotheses, best first."""
    results = state.beam.results()
    state.completions = state.completions[: len(results)]
    for comp, hyp in zip(state.completions, results):
        for token in hyp.token_ids:
            comp.token_ids.append(token)
            comp.detokenizer.add_token(token)
        comp.cumulative_logprob = hyp.cum_logprob
        comp.finish_reason = (FinishReason.STOP if hyp.ended_on_eos else FinishReason.LENGTH).value
    state.first_token_time = seq.first_token_time
    state.first_scheduled_time = seq.first_scheduled_time
    state.num_cached_tokens = seq.num_cached_tokens or 0
    state.num_preemptions = max(state.num_preemptions, seq.num_preemptions)
    state.tier_load_wait = max(state.tier_load_wait, seq.tier_load_wait)


def _output(state: _RequestState, finished: bool) -> RequestOutput:
    """Cumulative (and final-only) outputs copy everything so far; DELTA outputs carry only what
    is new since the last output, so a long stream costs O(its length) in all."""
    delta = state.params.output_kind is RequestOutputKind.DELTA
    if delta:
        completions = [_delta(i, c) for i, c in enumerate(state.completions)]
    else:
        completions = [
            CompletionOutput(
                index=i,
                text=c.detokenizer.visible_text(c.finish_reason is not None),
                token_ids=list(c.token_ids),
                finish_reason=c.finish_reason,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                stop_reason=c.stop_reason,
                cumulative_logprob=c.cumulative_logprob,
            )
            for i, c in enumerate(state.completions)
        ]
    prompt_logprobs = state.prompt_logprobs
    if delta:
        prompt_logprobs = None if state.sent_prompt_logprobs else prompt_logprobs
        state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_cached_tokens=state.num_cached_tokens,
        metrics=RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=state.first_scheduled_time,
            first_token_time=state.first_token_time,
            finish_time=time.time() if finished else None,
            num_preemptions=state.num_preemptions,
            tier_load_wait=state.tier_load_wait,
        ),
        prompt_logprobs=prompt_logprobs,
        embedding=state.embedding if finished else None,
    )


def _delta(index: int, c: _Completion) -> CompletionOutput:
    done = c.finish_reason is not None
    start = c.num_sent_tokens
    c.num_sent_tokens = len(c.token_ids)
    newly_finished = done and not c.reported_finish
    c.reported_finish = done
    return CompletionOutput(
        index=index,
        text=c.detokenizer.take_delta(done),
        token_ids=c.token_ids[start:],
        finish_reason=c.finish_reason if newly_finished else None,
        logprobs=c.logprobs[start:] if c.logprobs is not None else None,
        stop_reason=c.stop_reason if newly_finished else None,
    )


def merge_deltas(items: list[tuple[int, RequestOutput]]) -> list[tuple[int, RequestOutput]]:
    """Fold consecutive DELTA outputs of the same prompt into one; O(total size)."""
    by_index: dict[int, list[RequestOutput]] = {}
    for index, out in items:
        by_index.setdefault(index, []).append(out)
    merged = []
    for index in sorted(by_index):
        outs = by_index[index]
        if len(outs) == 1:
            merged.append((index, outs[0]))
            continue
        last = outs[-1]
        completions = []
        for k in range(len(last.outputs)):
            parts = [o.outputs[k] for o in outs]
            lps = [lp for p in parts if p.logprobs is not None for lp in p.logprobs]
            reason = next((p for p in parts if p.finish_reason is not None), None)
            completions.append(CompletionOutput(
                index=k,
                text="".join(p.text for p in parts),
                token_ids=[t for p in parts for t in p.token_ids],
                finish_reason=reason.finish_reason if reason else None,
                logprobs=lps if parts[0].logprobs is not None else None,
                stop_reason=reason.stop_reason if reason else None,
            ))
        merged.append((index, RequestOutput(
            request_id=last.request_id, prompt=last.prompt, prompt_token_ids=last.prompt_token_ids,
            outputs=completions, finished=last.finished, num_cached_tokens=last.num_cached_tokens,
            metrics=last.metrics, prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None),
            embedding=last.embedding,
        )))
    return merged
