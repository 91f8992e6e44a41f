"""Prometheus metrics named after vLLM's, fed from engine stats and request outputs.

Prefix `octavo:` by default; `vllm` (--metrics-prefix) gives every metric vLLM's exact name and
labels (model_name, engine), so what reads vLLM's /metrics (the Gateway API inference extension's
endpoint picker, llm-d, KServe, Dynamo planners, Grafana boards) reads Octavo's unchanged.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from octavo.config import CacheConfig
from octavo.memory import KVSizing
from octavo.outputs import EngineStats, LoRAStats, SpecDecodeStats
from octavo.request import RequestOutput
from octavo.sampling.params import SamplingParams

METRICS_PREFIXES = ("octavo", "vllm")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
# 1, 2, 5, 10, 20, 50, ... 1M: token counts of a request (vLLM's 1-2-5 series)
_TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)
_STEP_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


class EngineMetrics:
    """One registry per engine (no global state). `observe_step` after each step,
    `observe_output` for each RequestOutput, `observe_token_gap` between a request's tokens.
    `prefix`: octavo (default) or vllm (vLLM's names, plus its `engine` label)."""

    def __init__(self, model_name: str, prefix: str = "octavo") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.prefix = prefix
        # vLLM labels every engine metric with its engine index too (one engine per server here)
        base = {"model_name": model_name} | ({"engine": "0"} if prefix == "vllm" else {})
        labels, values = list(base), tuple(base.values())
        self._base_labels, self._base_values = labels, values
        r = self.registry
        hist, gauge, counter = self._hist, self._gauge, self._counter
        self._add_request_metrics()
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", _STEP_TOKEN_BUCKETS)
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use, 0 to 1.")
        # the endpoint picker's older name for the same gauge (the inference extension's protocol table)
        self.kv_usage_old = gauge("gpu_cache_usage_perc", "Share of KV-cache blocks in use, 0 to 1 (the "
                                  "older name of kv_cache_usage_perc).") if prefix == "vllm" else None
        self.running = gauge("num_requests_running", "Sequences in the running set.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions (the victim resumes from what is cached).")
        self.recomputed = counter("recomputed_tokens", "Tokens computed again after a preemption (the recompute tax).")
        self.repreemptions = counter("num_repreemptions", "Preemptions of a request preempted before (thrashing).")
        self.resumed = counter("num_resumed", "Admissions of a preempted request.")
        self.tier_hits = counter("kv_tier_hits", "Prompt tokens whose KV was loaded from the second KV tier.")
        self.tier_stored = counter("kv_tier_blocks_stored", "Blocks written to the second KV tier.")
        self.tier_loaded = counter("kv_tier_blocks_loaded", "Blocks loaded from the second KV tier.")
        self.tier_corrupt = counter("kv_tier_blocks_corrupt", "Tier loads refused by their checksum (recomputed).")
        self.tier_load_wait = hist(
            "kv_tier_load_wait_seconds", "Per request that loaded KV from the second tier: the steps it spent loading.",
            _LATENCY_BUCKETS)
        self.tier_usage = gauge("kv_tier_usage_perc", "Share of the second KV tier's blocks held, 0 to 1.")
        self.swaps = counter("num_swaps", "Preemptions whose blocks go through the second KV tier (the others recompute).")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of drafted tokens (a request's step with drafts).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens the model agreed with (kept).")
        self.spec_length = hist("spec_decode_acceptance_length", "Per verification: the drafts kept (0 to k).",
                                tuple(float(m) for m in range(17)))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.kv_blocks = gauge("kv_cache_num_blocks", "Blocks in the KV-cache pool.")
        self.kv_blocks_per_seq = gauge(
            "kv_cache_blocks_per_max_len_sequence",
            "Blocks one decoding sequence of max_model_len tokens holds (fewer than a block per 16 tokens "
            "and layer group where sliding-window layers give back blocks the window has passed).")
        self.max_concurrency = gauge(
            "kv_cache_max_concurrency", "Sequences of max_model_len tokens the KV cache holds at once (as at start-up).")
        self.decode_weight_bytes = gauge(
            "decode_weight_bytes", "Bytes of weights one decode step reads, as held (an untied embedding's table excluded).")
        self.kv_bytes_per_token = gauge(
            "kv_bytes_per_token", "Bytes of KV cache a token of context holds (all layers): a decode step reads it per token.")
        self._success = Counter(f"{prefix}:request_success", "Finished requests by finish reason.", [*labels, "finished_reason"], registry=r)
        self._cache_info = Gauge(
            f"{prefix}:cache_config_info", "The KV cache's configuration, in labels (value 1).",
            ["block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype", "enable_prefix_caching",
             "prefix_caching_hash_algo", "kv_cache_memory_bytes", "kv_cache_size_tokens", "kv_cache_max_concurrency",
             *labels[1:]], registry=r)
        self._lora_info = Gauge(
            f"{prefix}:lora_requests_info", "When the adapters in use last changed (Unix time); labels: the "
            "most adapters a step runs, the adapters of running and of waiting requests (comma-separated).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_labels: tuple[str, str, str] | None = None
        self.model_name = model_name
        self._last: EngineStats | None = None
        # the latest latencies, for the dashboard's live percentiles (bounded: a day's traffic holds no more)
        self.recent_ttft: deque[float] = deque(maxlen=256)
        self.recent_itl: deque[float] = deque(maxlen=1024)

    def _hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"{self.prefix}:{name}", doc, self._base_labels, buckets=buckets,
                         registry=self.registry).labels(*self._base_values)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"{self.prefix}:{name}", doc, self._base_labels, registry=self.registry).labels(*self._base_values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"{self.prefix}:{name}", doc, self._base_labels, registry=self.registry).labels(*self._base_values)

    def _add_request_metrics(self) -> None:
        """Per-request histograms: latencies, token counts and what was asked for."""
        hist = self._hist
        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens of a request.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the end of a request.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.", _LATENCY_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Time from first being scheduled to the end of a request.", _LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Time from first being scheduled to the first output token.", _LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Time from the first output token to the end of a request.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of a finished request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Output tokens of a finished request (all its completions).", _TOKEN_BUCKETS)
        self.request_params_n = hist("request_params_n", "The n (completions asked for) of a finished request.", _N_BUCKETS)
        self.request_params_max_tokens = hist(
            "request_params_max_tokens", "The max_tokens of a finished request that set one.", _TOKEN_BUCKETS)

    def observe_step(self, stats: EngineStats) -> None:
        s = stats.scheduler
        self.kv_usage.set(s.kv_cache_usage)
        if self.kv_usage_old is not None:
            self.kv_usage_old.set(s.kv_cache_usage)
        if s.num_scheduled_tokens and (self._last is None or stats.num_steps != self._last.num_steps):
            self.iteration_tokens.observe(s.num_scheduled_tokens)
        if stats.lora is not None:
            self._observe_lora(stats.lora)
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        last = self._last
        prev = last.scheduler if last else None
        for section, counters in (
            ("prefix", ((self.prefix_queries, "num_queries_tokens"), (self.prefix_hits, "num_hits_tokens"),
                        (self.tier_hits, "num_tier_hits_tokens"))),
            ("preemption", ((self.preemptions, "num_preemptions"), (self.recomputed, "num_recomputed_tokens"),
                            (self.repreemptions, "num_repreemptions"), (self.resumed, "num_resumed"),
                            (self.swaps, "num_swaps"))),
            ("tier", ((self.tier_stored, "num_stored"), (self.tier_loaded, "num_loaded"),
                      (self.tier_corrupt, "num_corrupt"))),
        ):
            now, before = getattr(s, section), getattr(prev, section) if prev else None
            for metric, name in counters if now is not None else ():
                metric.inc(getattr(now, name) - (getattr(before, name) if before is not None else 0))
        if s.tier is not None:
            self.tier_usage.set(s.tier.usage)
        self._observe_spec(stats.spec, last.spec if last else None)
        self.prompt_tokens.inc(stats.num_prompt_tokens_total - (last.num_prompt_tokens_total if last else 0))
        self.generation_tokens.inc(stats.num_generation_tokens_total - (last.num_generation_tokens_total if last else 0))
        self._last = stats

    def _observe_spec(self, s: SpecDecodeStats | None, prev: SpecDecodeStats | None) -> None:
        if s is None or not s.num_drafts or (prev is not None and s.num_drafts == prev.num_drafts):
            return
        self.spec_drafts.inc(s.num_drafts - (prev.num_drafts if prev else 0))
        self.spec_draft_tokens.inc(s.num_draft_tokens - (prev.num_draft_tokens if prev else 0))
        self.spec_accepted.inc(s.num_accepted_tokens - (prev.num_accepted_tokens if prev else 0))
        before = prev.acceptance_counts if prev else ()
        for m, count in enumerate(s.acceptance_counts):
            for _ in range(count - (before[m] if m < len(before) else 0)):
                self.spec_length.observe(m)

    def _observe_lora(self, lora: LoRAStats) -> None:
        """One series whose labels name the adapters in use, its value the time they last changed
        (vLLM keeps a series per change; the picker reads the newest: one is all it needs)."""
        labels = (str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting))
        if labels == self._lora_labels:
            return
        if self._lora_labels is not None:
            self._lora_info.remove(*self._lora_labels)
        self._lora_info.labels(*labels).set(time.time())
        self._lora_labels = labels

    def observe_kv_sizing(self, sizing: KVSizing, cache: CacheConfig | None = None, kv_dtype: str = "auto",
                          num_tier_blocks: int = 0) -> None:
        """The pool's capacity, once: the same figures as the start-up line (KVSizing.describe);
        with `cache`, vLLM's cache_config_info as well (`num_gpu_blocks` is the pool's blocks on
        any device, `num_cpu_blocks` the second tier's)."""
        self.kv_blocks.set(sizing.num_blocks)
        self.kv_blocks_per_seq.set(sizing.blocks_per_seq)
        self.max_concurrency.set(sizing.max_concurrency)
        if cache is not None:
            self._cache_info.labels(
                str(sizing.block_size), str(sizing.num_blocks), str(num_tier_blocks), kv_dtype,
                str(cache.enable_prefix_caching), cache.prefix_caching_hash_algo, str(sizing.num_bytes),
                str(sizing.num_tokens), str(sizing.max_concurrency), *self._base_values[1:]).set(1)

    def observe_read_bytes(self, weight_bytes: int, kv_bytes_per_token: float) -> None:
        """What a decode step reads, once: the weights as held, and the KV cache's bytes per token
        of context (all layers); `octavo bench serve` divides them by a TPOT for the bandwidth reached."""
        self.decode_weight_bytes.set(weight_bytes)
        self.kv_bytes_per_token.set(kv_bytes_per_token)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.recent_itl.append(seconds)

    def recent_latencies(self) -> dict[str, dict[str, float] | None]:
        """p50 / p90 / p99 in ms of the latest TTFTs and ITLs (None before any)."""
        def pct(values) -> dict[str, float] | None:
            if not values:
                return None
            ordered = sorted(values)
            return {f"p{q}": 1e3 * ordered[min(len(ordered) - 1, len(ordered) * q // 100)] for q in (50, 90, 99)}
        return {"ttft_ms": pct(self.recent_ttft), "itl_ms": pct(self.recent_itl)}

    def observe_output(self, out: RequestOutput, is_first: bool) -> None:
        m = out.metrics
        if is_first and m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            self.recent_ttft.append(max(0.0, m.first_token_time - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def observe_finished(self, out: RequestOutput, finish_reason: str | None, params: SamplingParams | None = None,
                         num_prompt_tokens: int | None = None, num_output_tokens: int | None = None) -> None:
        """A request's last output; `finish_reason` is its first completion's (one count per
        request, as a client sees one response); `params`: what it asked for. The token counts
        default to `out`'s own (pass them where outputs are deltas)."""
        m = out.metrics
        end = m.finish_time or time.time()
        self.e2e.observe(max(0.0, end - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.inference_time.observe(max(0.0, end - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None:
            self.decode_time.observe(max(0.0, end - m.first_token_time))
        self.request_prompt_tokens.observe(len(out.prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens)
        self.request_generation_tokens.observe(
            sum(len(c.token_ids) for c in out.outputs) if num_output_tokens is None else num_output_tokens)
        if params is not None:
            self.request_params_n.observe(params.n)
            if params.max_tokens is not None:
                self.request_params_max_tokens.observe(params.max_tokens)
        if m.tier_load_wait > 0:
            self.tier_load_wait.observe(m.tier_load_wait)
        self._success.labels(*self._base_values, finish_reason or "abort").inc()
