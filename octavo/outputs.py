"""The plain data that crosses one engine step: SchedulerOutput to the runner, ModelRunnerOutput back,
and what a step leaves for logs, metrics and the dashboard (SchedulerStats, EngineStats, StepLog)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """One row of a step's sampling: the sequence that receives the token sampled from its
    request's last position, and what the sampler, its seed and its grammar read for it.

    An n > 1 request's prompt feeds n rows at once when it forks: row 0 is the request itself
    (its own output so far), rows 1..n-1 the new sequences (nothing generated yet). The runner,
    the sampler's penalties and the grammar masks all read these rows, never re-derive them."""

    seq_id: str
    sample_index: int = 0  # which of the user's n completions it is (seeds differ by it)
    output_token_ids: list[int] = field(default_factory=list)  # the scheduler's own list: read only
    # speculative decoding: tokens drafted after the request's last token, computed in this step
    # at the positions after it; the runner samples every one of those positions as it would
    # without them and keeps the drafts up to the first that differs from its sample
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions starting at `start_pos`.

    `samples` is empty for a prefill chunk that does not reach the end of the known tokens;
    otherwise it holds the rows that sample from this request's last position (see SampleRow).
    The list fields are references to the scheduler's own lists: read them, never write them.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_tables: list[list[int]]  # one per KV group (NULL_BLOCK_ID where a window holds none)
    sampling_params: SamplingParams
    samples: list[SampleRow]
    prompt_token_ids: list[int]
    lora_id: int | None = None  # the LoRA adapter its tokens run with

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sample_ids(self) -> list[str]:
        return [row.seq_id for row in self.samples]


@dataclass(slots=True)
class TierTransfer:
    """One block moving between the pool and the second KV tier: pool block `block_id`, tier
    slot `slot`, content `key` = (KV group, chained block hash), which the tier stores with it.
    A load names the request whose table the block joins (the only one that reads it this step)."""

    block_id: int
    slot: int
    key: tuple[int, bytes]
    request_id: str | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids, before forward
    finished_request_ids: list[str] = field(default_factory=list)  # ended since the last step
    preempted_request_ids: list[str] = field(default_factory=list)
    # Second KV tier. stores: blocks whose cached content this step evicts; the runner copies
    # them out before anything writes the pool (then writes them to the tier off the step's
    # path). loads: tier slots to read into pool blocks, held for a waiting request or in a
    # running request's table (read before the forward, which computes after them); the runner
    # reports each one (checksum passed or not) in this step's ModelRunnerOutput.
    tier_stores: list[TierTransfer] = field(default_factory=list)
    tier_loads: list[TierTransfer] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class PooledChunk:
    start_pos: int  # the chunk's first position
    num_tokens: int
    values: list[float]  # [hidden]: the sum ("mean") or the one state ("last", "cls")


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per sequence id that sampled (see ScheduledRequest.samples) its new tokens: one, or after
    verifying drafts the drafts kept and then one more (sampling/verify.py); their logprobs where
    asked, one per token."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> logprobs of the prompt tokens at positions [start, start + len) computed this
    # step, as (start, entries); only for requests asking prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # request id -> what its embedding (SamplingParams.pooling) takes from this step's chunk: the
    # sum of the chunk's final hidden states ("mean"), or the state of its last / first prompt token
    # ("last" / "cls") when the chunk holds it; as plain floats (the scheduler is pure Python)
    pooled: dict[str, PooledChunk] = field(default_factory=dict)
    # Second KV tier: pool block id -> whether its load passed its checksum (every load of the
    # step), and (slot, written) of the stores finished since the last step (any step's)
    tier_loaded: dict[int, bool] = field(default_factory=dict)
    tier_stored: list[tuple[int, bool]] = field(default_factory=list)
    tier_read_seconds: float = 0.0  # how long the forward waited for the loads it reads
    # requests left out of the step because a block they read failed its load (their chunk is void)
    left_out: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PrefixCacheStats:
    """The prefix cache's counters since start, in tokens (KVCacheManager.stats)."""

    num_queries_tokens: int = 0
    num_hits_tokens: int = 0  # from either tier
    num_tier_hits_tokens: int = 0  # of those, tokens whose blocks were loaded from the second tier


@dataclass(slots=True)
class PreemptionStats:
    """Preemption's counters since start (the Scheduler's)."""

    num_preemptions: int = 0
    num_repreemptions: int = 0  # preemptions of a request preempted before
    num_resumed: int = 0  # admissions of a preempted request
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption (the recompute tax)
    num_swaps: int = 0  # preemptions whose blocks go through the second tier (the others recompute)


@dataclass(slots=True)
class TierReport:
    """The second KV tier after a step (TierConnector.report): its size, use and counters since start."""

    num_blocks: int
    usage: float
    num_stored: int  # blocks written
    num_loaded: int  # blocks loaded that passed their checksum
    num_corrupt: int  # loads refused by their checksum
    num_load_rounds: int  # rounds of loads (a running request's next blocks)


@dataclass(slots=True)
class LoRAStats:
    """The adapters of unfinished requests after a step, by name (what vLLM's lora_requests_info
    reports: an endpoint picker routes a request to a server already running its adapter)."""

    max_loras: int  # adapters one step may run
    running: tuple[str, ...] = ()  # adapters of running requests, sorted
    waiting: tuple[str, ...] = ()  # adapters of waiting requests (none of them running), sorted


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot after a step, for logs and metrics, one section per feature; counters are
    cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_scheduled_tokens: int
    num_scheduled_requests: int
    prefix: PrefixCacheStats = field(default_factory=PrefixCacheStats)  # a copy
    preemption: PreemptionStats = field(default_factory=PreemptionStats)  # a copy
    tier: TierReport | None = None  # None without a second tier


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative decoding's counters since start (spec_decode.controller)."""

    num_drafts: int = 0  # verifications of drafted tokens (one per request per step that drafted)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_counts: list[int] = field(default_factory=list)  # [m]: verifications that accepted m drafts


@dataclass(slots=True)
class EngineStats:
    """Scheduler snapshot after the last step plus cumulative token counters, for logs and metrics."""

    scheduler: SchedulerStats
    num_prompt_tokens_total: int  # prompt tokens computed (prefix hits excluded, recomputes included)
    num_generation_tokens_total: int
    num_steps: int
    spec: SpecDecodeStats | None = None  # a copy; None without speculative decoding
    lora: LoRAStats | None = None  # None with LoRA off


@dataclass(slots=True)
class StepRecord:
    """One engine step, as the timeline shows it."""

    step: int
    end_time: float  # time.time() when it ended
    seconds: float
    num_prefill_tokens: int  # prompt tokens computed (chunks, recomputes)
    num_decode_tokens: int  # tokens of requests past their prompt (decodes and verified drafts)
    num_requests: int
    num_preempted: int


class StepLog:
    """The last `maxlen` steps (a ring: a page left open for a day holds no more than this)."""

    def __init__(self, maxlen: int = 240) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
