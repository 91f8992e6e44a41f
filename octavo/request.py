"""Request state inside the engine (written only by the Scheduler) and the outputs users receive."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from octavo.beam_search import BeamGroup
from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(slots=True)
class Request:
    """One sequence being generated. The Scheduler is its only writer; everyone else reads.

    A request asked with n > 1 is one sequence until its prompt is computed; then the scheduler
    forks it into n sequences that share the prompt's KV blocks (see `Scheduler.update`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    parent_id: str | None = None  # the id the user knows; None means request_id itself
    sample_index: int = 0  # which of the n completions this sequence is
    num_samples_pending: int = 1  # > 1 only for the first sequence of an n > 1 request, until forked
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ... (prompt_logprobs)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission, in tokens
    num_preemptions: int = 0
    num_computed_before: int = 0  # the most tokens it had computed before a preemption (a high-water mark)
    tier_load_wait: float = 0.0  # seconds of steps it spent loading blocks from the second KV tier
    finish_reason: FinishReason | None = None
    admit_seq: int = 0  # admission order, for choosing preemption victims
    admit_step: int = 0  # the scheduler step of its last admission (a resumed request is not a victim soon)
    queued_step: int = 0  # the scheduler step it last entered the waiting queue (cache-aware aging)
    num_passed_over: int = 0  # steps in which a later arrival was admitted while it waited (cache-aware)
    # speculative decoding: the drafts its scheduled step verifies (set when it is scheduled; its
    # drafting record is the SpecDecodeController's)
    spec_token_ids: list[int] = field(default_factory=list)
    pin: bool = False  # its prompt's blocks stay in the pool for good once it ends (a pinned prefix)
    # the largest prompt chunk one step computes for it (None: the step's budget): set at admission
    # when its sliding-window groups fit the pool only in smaller chunks (limits.RequestLimits.check)
    max_chunk_tokens: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    beam: BeamGroup | None = None  # the beam search this sequence is a beam of (shared by its beams)
    lora_id: int | None = None  # the LoRA adapter it runs with (None: the base model)
    # What its blocks' hashes carry for the adapter: a digest of the adapter's files (an id may
    # name another adapter after an unload or a restart; its KV must not be served to this one's)
    lora_cache_key: str | None = None
    # an embedding request (sampling_params.pooling): the pooled states so far (a running sum for
    # "mean") and, once its prompt is computed, the embedding
    pooled_sum: list[float] | None = None
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def user_request_id(self) -> str:
        return self.parent_id if self.parent_id is not None else self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most output tokens this request may produce (max_tokens None: unbounded)."""
        max_tokens = self.sampling_params.max_tokens
        return self.num_prompt_tokens + (max_tokens if max_tokens is not None else 0)

    def push_token(self, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """Append a sampled token (and its logprob, when asked for)."""
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = now

    def stop_reason(self, max_model_len: int) -> FinishReason | None:
        """Why the request ends with its last token (EOS, a stop token, max_tokens,
        max_model_len), or None."""
        params = self.sampling_params
        token, num_out = self.output_token_ids[-1], self.num_output_tokens
        # Under min_tokens the sampler bans EOS, unless a grammar leaves no other token (it is
        # complete): then the grammar wins and the request ends (it repeated EOS until min_tokens)
        if not params.ignore_eos and token in self.eos_token_ids and (
                num_out >= params.min_tokens or params.structured_outputs is not None):
            return FinishReason.STOP
        if num_out >= params.min_tokens and token in params.stop_token_ids:
            return FinishReason.STOP
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def fork(self, child_id: str, index: int) -> Request:
        """A new running sequence with this one's tokens so far (an n > 1 completion forked after
        the prompt, `index` its place among them; or a beam forked mid-generation). Its blocks
        are the KV cache's to share (KVCacheManager.fork)."""
        return Request(
            request_id=child_id,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            beam=self.beam,
            lora_id=self.lora_id,
            lora_cache_key=self.lora_cache_key,
            first_token_time=self.first_token_time,
            sampling_params=self.sampling_params,
            arrival_time=self.arrival_time,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            cache_salt=self.cache_salt,
            parent_id=self.user_request_id,
            sample_index=index,
            status=RequestStatus.RUNNING,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            admit_seq=self.admit_seq,
            max_chunk_tokens=self.max_chunk_tokens,
        )


def check_inputs(prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, vocab_size: int) -> list[int]:
    """A request's token ids (a copy) if they, its stop token ids, its logit_bias keys and its
    cache salt can be used with a vocabulary of `vocab_size`; else ValueError naming what not."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string (or absent)")
    bad_stops = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad_stops[:5]}")
    bad_allowed = [t for t in (getattr(params, "allowed_token_ids", None) or ()) + (getattr(params, "logprob_token_ids", None) or ())
                   if not 0 <= t < vocab_size]
    if bad_allowed:
        raise ValueError(f"allowed_token_ids and logprob_token_ids must be token ids in [0, {vocab_size}); "
                         f"got {bad_allowed[:5]}")
    bad_bias = [t for t, _ in getattr(params, "logit_bias", ()) if not 0 <= t < vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}); got {bad_bias[:5]}")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt_token_ids):
        raise ValueError("prompt token ids must be integers")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    return list(prompt_token_ids)


def child_request_id(parent_id: str, index: int) -> str:
    """Internal id of completion `index` of an n > 1 request (index 0 keeps the parent's own sequence)."""
    return f"{parent_id}#{index}"


@dataclass(slots=True)
class CompletionOutput:
    """One of the n completions of a request, as the user sees it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    cumulative_logprob: float | None = None  # beam search: the hypothesis' summed logprob

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None  # queue time = first_scheduled_time - arrival_time
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    tier_load_wait: float = 0.0  # seconds of steps spent loading its blocks from the second KV tier


@dataclass(slots=True)
class RequestOutput:
    """What `generate` returns and `step` emits for a request: its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # prompt_logprobs: None for the first prompt token (nothing predicts it), then each token's
    # logprob and its top alternatives; only when asked, and (DELTA outputs) only in the first output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, in its finished output
