"""AsyncEngine: one thread runs LLMEngine steps; asyncio handlers add requests and read their outputs.

The engine thread owns the LLMEngine outright. Handlers send it commands (add a batch of prompts,
abort, call a function) through a queue; commands are applied between steps, so a step never
races an add or abort. Outputs are DELTAs (only what is new) pushed into the handler's
`OutputCollector` with call_soon_threadsafe; a slow reader's collector holds its backlog, nothing
more, and merges it when read.

If a step raises, the engine is dead: every registered and every queued request fails with
`EngineDeadError`, later submissions are refused at once, `is_healthy` turns False and `on_dead`
is called (the server then exits non-zero so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octavo.dashboard.snapshot import block_tokens, build_snapshot
from octavo.engine import LLMEngine
from octavo.kv_cache.events import hash_as_int
from octavo.lora.request import LoRARequest
from octavo.metrics import EngineMetrics
from octavo.output_processor import merge_deltas
from octavo.request import RequestOutput
from octavo.sampling.params import SamplingParams

if TYPE_CHECKING:
    from octavo.config import EngineConfig
    from octavo.structured.manager import StructuredOutputManager

logger = logging.getLogger("octavo.server")


class EngineStopped(RuntimeError):
    """The server is shutting down and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; this process can no longer generate."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class LoRANotLoadedError(ValueError):
    """The request's LoRA adapter was unloaded before the engine took the request (HTTP 404)."""


class OutputCollector:
    """The event-loop side of one submission (one HTTP request's prompts). Lives on the loop:
    the engine thread only reaches it through call_soon_threadsafe."""

    def __init__(self, num_requests: int) -> None:
        self._items: list[tuple[int, RequestOutput]] = []
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self.num_open = num_requests

    def push(self, index: int, out: RequestOutput) -> None:
        self._items.append((index, out))
        if out.finished:
            self.num_open -= 1
        self._event.set()

    def close_one(self) -> None:
        """A request ended without a final output (aborted)."""
        self.num_open -= 1
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._event.set()

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """Everything pushed since the last call, merged per prompt, in prompt order; [] once every
        request has ended. Raises the failure (after handing out what came before it)."""
        while not self._items and self._error is None and self.num_open > 0:
            await self._event.wait()
            self._event.clear()
        if self._items:
            items, self._items = self._items, []
            return merge_deltas(items)
        if self._error is not None:
            raise self._error
        return []


@dataclass(slots=True)
class _Registered:
    """Engine-thread bookkeeping of one running request."""

    loop: asyncio.AbstractEventLoop
    collector: OutputCollector
    index: int
    params: SamplingParams | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None  # of completion 0: the label of the success metric
    num_prompt_tokens: int = 0  # outputs are deltas: the request's totals, for its metrics
    num_output_tokens: int = 0


@dataclass(slots=True)
class _Add:
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    collector: OutputCollector
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        metrics: EngineMetrics,
        log_interval_s: float = 10.0,
        max_waiting_requests: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`engine`: the engine, or a function that builds it. A function is called on the engine
        thread by `start()`, so that one thread runs every OpenMP region of the process: libgomp
        keeps a thread pool per thread that opens regions, and a second pool on two cores made
        every step ~2x slower (measured: a batch-1 step 10.2 ms on the loading thread, 21.4 ms
        on another)."""
        self.engine: LLMEngine = None if callable(engine) and not isinstance(engine, LLMEngine) else engine  # type: ignore[assignment]
        self._factory = engine if self.engine is None else None
        self._ready = threading.Event()
        self._factory_error: BaseException | None = None
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = on_dead
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "put a command" against "die and drain the queue"
        self._streams: dict[str, _Registered] = {}
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._stop = threading.Event()
        self._accepting = True
        self._last_log = time.monotonic()
        self._last_log_stats = None
        self.error: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; with a factory, return once the engine is built (re-raising
        what building it raised). Idempotent."""
        if self._thread.ident is not None:
            return
        self._thread.start()
        if self._factory is not None:
            self._ready.wait()
            if self._factory_error is not None:
                raise self._factory_error

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop admitting, abort what is left, stop the thread."""
        self._accepting = False
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    # ---- what the routes read (the engine's fixed parts; safe from any thread) --------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def grammar_cache(self) -> StructuredOutputManager:
        """The engine's compiled-grammar cache (thread-safe; the routes fill and hold entries)."""
        return self.engine.structured

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded when asked (the admin routes keep their own map in step after)."""
        return self.engine.list_loras()

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests registered with the engine and not yet ended (read from any thread)."""
        return len(self._streams)

    # ---- handler side ------------------------------------------------------------------------

    def _submit(self, cmd: Any) -> None:
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine failed and cannot serve: {self.error!r}")
            if not self._accepting:
                raise EngineStopped("the server is shutting down")
            self._commands.put(cmd)

    async def add(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> OutputCollector:
        """Queue the prompts as one unit and wait until the engine has taken all of them or none.

        Raises ValueError (a refusal, naming the prompt), EngineOverloadedError, EngineStopped or
        EngineDeadError. If the caller is cancelled meanwhile, the requests are aborted."""
        loop = asyncio.get_running_loop()
        collector = OutputCollector(len(prompts))
        cmd = _Add(list(request_ids), prompts, params, priority, cache_salt, collector, loop, loop.create_future(),
                   lora_request)
        self._submit(cmd)
        try:
            await cmd.done
        except asyncio.CancelledError:
            self.abort(request_ids)
            raise
        return collector

    def abort(self, request_ids: list[str]) -> None:
        """End the requests wherever they are (no-op for ended ones); their collector is closed."""
        self._commands.put(("abort", list(request_ids)))

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter between steps (ValueError if it cannot be used)."""
        await self._call(lambda e: e.add_lora(lora))

    async def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter between steps (ValueError while a request runs with it)."""
        await self._call(lambda e: e.remove_lora(lora_id))

    async def dashboard_snapshot(self) -> dict:
        """The dashboard's view of the pool, the requests and the last steps, with the recent
        latencies, built between steps."""
        metrics = self.metrics
        return await self._call(lambda e: {**build_snapshot(e.scheduler, e.step_log, spec=e.get_stats().spec),
                                           "latency": metrics.recent_latencies()})

    async def block_holders(self, block_id: int) -> tuple[list[str], list[int]] | None:
        """(the live sequences holding pool block `block_id`, the tokens it holds), or None when
        no live sequence holds it."""
        return await self._call(lambda e: block_tokens(e.scheduler, block_id))

    async def kv_cache_report(self) -> dict:
        """Pool counts and the KV-cache invariant check (O(num_blocks); the debug route's)."""
        return await self._call(_kv_cache_report)

    async def cached_blocks(self) -> list[int]:
        """The first KV group's cached block hashes, pool and second tier, in vLLM's integer form
        (a hash's last 8 bytes): what a KV-aware router matches prompts against (O(blocks))."""
        return await self._call(_cached_blocks)

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        cmd = _Call(fn, loop, loop.create_future())
        self._submit(cmd)
        return await cmd.done

    # ---- engine thread -----------------------------------------------------------------------

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._apply_add(cmd)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(self.engine)
            except Exception as exc:
                cmd.loop.call_soon_threadsafe(_set_exception, cmd.done, exc)
            else:
                cmd.loop.call_soon_threadsafe(_set_result, cmd.done, result)
        elif isinstance(cmd, tuple) and cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            for rid in cmd[1]:
                reg = self._streams.pop(rid, None)
                if reg is not None:
                    reg.loop.call_soon_threadsafe(reg.collector.close_one)

    def _apply_add(self, cmd: _Add) -> None:
        limit = self.max_waiting_requests
        num_waiting = self.engine.num_waiting_requests()
        # the limit bounds the queue, not one request: a request of more prompts than the limit
        # (a rerank of 1,024 documents) is taken when nothing waits, and a 429 says what is true
        if limit is not None and num_waiting and num_waiting + len(cmd.prompts) > limit:
            adds = f"; this request adds {len(cmd.prompts)}" if len(cmd.prompts) > 1 else ""
            exc: Exception = EngineOverloadedError(
                f"{num_waiting} requests are already waiting (limit {limit}{adds}); retry later")
            cmd.loop.call_soon_threadsafe(_set_exception, cmd.done, exc)
            return
        if cmd.lora_request is not None and not self.engine.has_lora(cmd.lora_request):
            # unloaded while this request was on its way: not loaded again behind the server's back
            gone = LoRANotLoadedError(f"The model `{cmd.lora_request.lora_name}` does not exist (its adapter was unloaded).")
            cmd.loop.call_soon_threadsafe(_set_exception, cmd.done, gone)
            return
        added: list[str] = []
        try:
            for i, (rid, ids) in enumerate(zip(cmd.request_ids, cmd.prompts)):
                try:
                    self.engine.add_request(rid, ids, cmd.params, priority=cmd.priority, cache_salt=cmd.cache_salt,
                                            lora_request=cmd.lora_request)
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}" if len(cmd.prompts) > 1 else str(exc)) from exc
                added.append(rid)
        except ValueError as exc:  # refused: keep none of the batch
            self.engine.abort_request(added)
            cmd.loop.call_soon_threadsafe(_set_exception, cmd.done, exc)
            return
        for i, rid in enumerate(cmd.request_ids):
            self._streams[rid] = _Registered(cmd.loop, cmd.collector, i, cmd.params)
        cmd.loop.call_soon_threadsafe(_set_result, cmd.done, None)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; returns whether any was applied."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            if cmd is not None:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
                engine = self.engine
                tier = engine.get_stats().scheduler.tier
                self.metrics.observe_kv_sizing(engine.kv_sizing, engine.config.cache, engine.config.cache.cache_dtype,
                                               0 if tier is None else tier.num_blocks)
                sizing = engine.kv_sizing
                self.metrics.observe_read_bytes(engine.decode_weight_bytes, sizing.num_bytes / max(sizing.num_tokens, 1))
            except BaseException as exc:
                self._factory_error = exc
                return
            finally:
                self._ready.set()
        try:
            while not self._stop.is_set():
                applied = self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if not self.engine.has_unfinished_requests():
                    if applied:  # e.g. aborts while idle: the gauges show the freed blocks
                        self.metrics.observe_step(self.engine.get_stats())
                    continue
                outputs = self.engine.step()
                now = time.time()
                self.metrics.observe_step(self.engine.get_stats())
                for out in outputs:
                    self._deliver(out, now)
                self._maybe_log()
        except BaseException as exc:  # the loop must never die silently: fail everything, loudly
            logger.exception("engine loop failed; failing every request")
            self._die(exc)
            self._close_engine()
            return
        self._close(EngineStopped("the server shut down before this request finished"))
        self._close_engine()

    def _close_engine(self) -> None:
        """Release what the engine holds outside this process (tensor-parallel workers)."""
        try:
            self.engine.close()
        except Exception:  # a dead worker's group may not close cleanly: the process is exiting anyway
            logger.warning("closing the engine failed", exc_info=True)

    def _die(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self.error = exc
        self._close(dead)
        if self.on_dead is not None:
            self.on_dead(exc)

    def _close(self, exc: BaseException) -> None:
        """Fail every registered request and every command still queued (none can be added after:
        `_submit` checks `error` / `_accepting` under the same lock)."""
        with self._lock:
            self._accepting = False
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for cmd in pending:
            if isinstance(cmd, (_Add, _Call)):
                cmd.loop.call_soon_threadsafe(_set_exception, cmd.done, exc)
        for reg in self._streams.values():
            reg.loop.call_soon_threadsafe(reg.collector.fail, exc)
        try:
            self.engine.abort_request(list(self._streams))
        except Exception:  # a dead engine may not even abort cleanly; the process is going away
            logger.exception("could not abort requests after the engine stopped")
        self._streams.clear()

    def _deliver(self, out: RequestOutput, now: float) -> None:
        reg = self._streams.get(out.request_id)
        if reg is None:
            return
        num_new = sum(len(c.token_ids) for c in out.outputs)
        reg.num_output_tokens += num_new
        reg.num_prompt_tokens = reg.num_prompt_tokens or len(out.prompt_token_ids)
        if reg.last_token_time is not None and num_new:
            self.metrics.observe_token_gap(now - reg.last_token_time)
        self.metrics.observe_output(out, is_first=reg.last_token_time is None)
        if num_new:
            reg.last_token_time = now
        if out.outputs and out.outputs[0].finish_reason is not None:
            reg.finish_reason = out.outputs[0].finish_reason
        if out.finished:
            self.metrics.observe_finished(out, reg.finish_reason, reg.params, reg.num_prompt_tokens,
                                          reg.num_output_tokens)
            del self._streams[out.request_id]
        reg.loop.call_soon_threadsafe(reg.collector.push, reg.index, out)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.log_interval_s:
            return
        stats, last = self.engine.get_stats(), self._last_log_stats
        s = stats.scheduler
        prompt_tps = (stats.num_prompt_tokens_total - (last.num_prompt_tokens_total if last else 0)) / elapsed
        gen_tps = (stats.num_generation_tokens_total - (last.num_generation_tokens_total if last else 0)) / elapsed
        hit_rate = s.prefix.num_hits_tokens / s.prefix.num_queries_tokens if s.prefix.num_queries_tokens else 0.0
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
            "KV usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
            prompt_tps, gen_tps, s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * hit_rate, s.preemption.num_preemptions,
        )
        self._last_log, self._last_log_stats = now, stats


def _kv_cache_report(engine: LLMEngine) -> dict:
    kv = engine.scheduler.kv_cache.view()
    return {
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "num_cached_blocks": kv.num_cached_blocks,
        "num_running": len(engine.scheduler.running),
        "num_waiting": engine.scheduler.num_waiting,
        "problems": kv.check_invariants(),
    }


def _set_result(fut: asyncio.Future, value: Any = None) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _cached_blocks(engine: LLMEngine) -> list[int]:
    kv = engine.scheduler.kv_cache
    keys = list(kv.pool.cached)
    if kv.tier is not None:
        keys += kv.tier.ready_keys()
    return [hash_as_int(h) for g, h in keys if g == 0]
