"""AsyncEngine: one thread runs LLMEngine steps; asyncio handlers add requests and read their outputs.

The engine thread owns the LLMEngine outright. Handlers send it commands (add, abort) through a
queue and get per-request asyncio queues back, fed with RequestOutputs through the event loop's
call_soon_threadsafe. Commands are applied between steps, so a step never races an add or abort.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from octavo.engine import LLMEngine
from octavo.metrics import EngineMetrics
from octavo.request import RequestOutput
from octavo.sampling.params import SamplingParams

logger = logging.getLogger("octavo.server")


class EngineStopped(RuntimeError):
    pass


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_token_time: float | None = None
    num_tokens: int = 0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: _Stream
    done: asyncio.Future = field(default=None)  # type: ignore[assignment]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, log_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_interval_s = log_interval_s
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._stop = threading.Event()
        self._accepting = True
        self._last_log = time.monotonic()
        self._last_log_stats = None
        self.error: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop admitting, abort what is left, stop the thread."""
        self._accepting = False
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- handler side ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs until finished. Raises ValueError (before the
        first output) if the engine refuses it. Leaving the iteration early aborts the request."""
        if not self._accepting or not self.is_healthy:
            raise EngineStopped("the server is shutting down" if not self._accepting else f"engine failed: {self.error}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        cmd = _Add(request_id, prompt, params, priority, cache_salt, stream, loop.create_future())
        self._commands.put(cmd)
        finished = False
        try:
            await cmd.done  # raises the engine's ValueError, if any
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- engine thread -----------------------------------------------------------------------

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, priority=cmd.priority, cache_salt=cmd.cache_salt)
            except Exception as exc:  # refused: tell the handler, keep nothing
                cmd.stream.loop.call_soon_threadsafe(_set_exception, cmd.done, exc)
                return
            self._streams[cmd.request_id] = cmd.stream
            cmd.stream.loop.call_soon_threadsafe(_set_result, cmd.done)
        elif isinstance(cmd, tuple) and cmd[0] == "abort":
            self.engine.abort_request(cmd[1])
            self._streams.pop(cmd[1], None)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is not None:
                self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set() or not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                now = time.time()
                self.metrics.observe_step(self.engine.get_stats())
                for out in outputs:
                    self._deliver(out, now)
                self._maybe_log()
        except BaseException as exc:  # the loop must never die silently: fail every open stream
            logger.exception("engine loop failed")
            self.error = exc
            for stream in self._streams.values():
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(f"engine failed: {exc}"))
        finally:
            for rid in list(self._streams):
                self.engine.abort_request(rid)
            self._streams.clear()

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if stream.last_token_time is not None and num_tokens > stream.num_tokens:
            self.metrics.observe_token_gap(now - stream.last_token_time)
        self.metrics.observe_output(out, is_first=stream.last_token_time is None)
        stream.last_token_time, stream.num_tokens = now, num_tokens
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        if out.finished:
            del self._streams[out.request_id]

    def _maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.log_interval_s:
            return
        stats, last = self.engine.get_stats(), self._last_log_stats
        s = stats.scheduler
        prompt_tps = (stats.num_prompt_tokens_total - (last.num_prompt_tokens_total if last else 0)) / elapsed
        gen_tps = (stats.num_generation_tokens_total - (last.num_generation_tokens_total if last else 0)) / elapsed
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        logger.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
            "KV usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
            prompt_tps, gen_tps, s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * hit_rate, s.num_preemptions,
        )
        self._last_log, self._last_log_stats = now, stats


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
