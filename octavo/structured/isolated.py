"""Compiling requests' grammars in worker processes: a deadline, a way to stop one, and a fair turn
for every client.

A compile cannot be interrupted inside xgrammar, and some are slow: a 158-character regex took ~30
CPU-seconds. Compiled in the server's process it held a thread of the shared pool the whole time
(stalling tokenisation for everyone) and kept going after its client left. So compiles run in
worker processes (forked from a forkserver that has xgrammar loaded, niced below the engine),
`default_num_workers()` of them. Each worker is started once with the tokenizer's info and keeps
its compiler: a new schema then costs its compile (~5 ms for a small schema) and shipping the
compiled grammar back (~2-5 ms each way), where a child started per compile, given the 1.6 MB
tokenizer info and a cold schema checker each time, took ~0.3 s (issue 36: ~2.4 new schemas a
second). A worker whose compile passes the deadline, or whose client leaves, is killed (nothing
else stops xgrammar) and a new one started in its place. Small plain JSON schemas (`is_quick`:
no regex, no large size bound, a few KiB), whose compile time is bounded by their size, compile
on a niced thread of this process instead: half the CPU (no shipping), the GIL let go.

Queued compiles wait in one queue per client and are taken round-robin across clients, so one
client's stream of new schemas delays another's new schema by at most one compile per worker;
requests whose grammar is cached never queue here at all. A client may queue at most
`max_queued_per_client` compiles (more is GrammarQueueFull: HTTP 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from octavo.forkserver import WorkerProcess
from octavo.sampling.params import StructuredOutputsParams
from octavo.structured.manager import GrammarError, StructuredOutputManager, _xgr, compile_spec

logger = logging.getLogger("octavo.structured")

DEFAULT_COMPILE_TIMEOUT_S = 10.0  # a small schema takes ~5 ms, a large one ~0.5 s
DEFAULT_MAX_QUEUED_PER_CLIENT = 64
# A JSON schema this small, with no regex and no size bound over this, compiles in ~5 ms: it is
# compiled in the server's process (on a niced thread; xgrammar lets go of the GIL) instead of a
# worker, which would cost it ~6 ms more of serialising it there and rebuilding it here. Regexes,
# grammars and larger schemas (xgrammar's compile time grows with repetition bounds: a regex of
# "{0,9000}"s took seconds) go to a worker, where a deadline can stop them.
QUICK_SCHEMA_CHARS = 2048
QUICK_SCHEMA_BOUND = 256
_BOUND_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
_REGEX_KEYWORDS = ("pattern", "patternProperties", "format", "propertyNames")
QUICK_COMPILE_WARN_S = 0.2


def is_quick(params: StructuredOutputsParams) -> bool:
    """Whether `params` is a small plain JSON schema (see QUICK_SCHEMA_CHARS), safe to compile in
    the server's process: its compile time is bounded by its size."""
    if params.kind == "json_object":
        return True
    if params.kind != "json" or len(params.json) > QUICK_SCHEMA_CHARS:
        return False
    try:
        schema = json.loads(params.json)
    except ValueError:
        return False
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k in node for k in _REGEX_KEYWORDS):
                return False
            for key in _BOUND_KEYWORDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > QUICK_SCHEMA_BOUND:
                    return False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return True


def default_num_workers() -> int:
    """Compile workers for this machine: half its cores (the engine keeps the rest), at least two
    (a compile running into its deadline leaves the other free), at most eight."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(2, min(8, cores // 2))


class GrammarQueueFull(RuntimeError):
    """A client has queued as many compiles as it may; it must wait for them (HTTP 429)."""


class _Stopped(Exception):
    """The job was cancelled (its client left) or the pool closed."""


def _yield_to_the_engine() -> None:
    """Below the engine's priority (nice 10; measured against 19, which starved compiles while the
    engine was busy, and 0: docs/BENCHMARKS.md)."""
    with contextlib.suppress(OSError):
        os.nice(10)


def _lower_this_threads_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _worker_main(conn: Any, info_json: str) -> None:
    """In a worker process: build the compiler once, then compile each StructuredOutputsParams
    received, answering ("ok", serialised grammar) or ("error", message); None ends it."""
    _yield_to_the_engine()
    xgr = _xgr()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)
    with contextlib.suppress(GrammarError):  # warm the schema checker (jsonschema's metaschemas) before the first job
        compile_spec(compiler, StructuredOutputsParams(json_object=True))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return
        if params is None:
            return
        try:
            conn.send(("ok", compile_spec(compiler, params).serialize_json()))
        except GrammarError as exc:
            conn.send(("error", str(exc)))


@dataclass(slots=True, eq=False)
class _Job:
    params: StructuredOutputsParams
    client: str
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Worker:
    """One worker process and the thread that feeds it jobs from the pool."""

    def __init__(self, pool: IsolatedCompiler, index: int) -> None:
        self.pool, self.index = pool, index
        self.process: Any = None
        self.busy = False
        self.thread = threading.Thread(target=self._loop, name=f"octavo-grammar-worker-{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        _lower_this_threads_priority()  # it deserialises what the worker compiled
        while True:
            job = self.pool._next_job()
            if job is None:
                self._stop_process()
                return
            self.busy = True
            try:
                result = self._run(job)
            except BaseException as exc:  # GrammarError for the caller; _Stopped when nobody waits
                self.busy = False  # before the caller wakes: it may count the compiles running
                job.future.set_exception(exc)
            else:
                self.busy = False
                job.future.set_result(result)

    def _start_process(self) -> None:
        self.process = WorkerProcess(_worker_main, (self.pool._info(),), f"octavo-grammar-compile-{self.index}")

    def _stop_process(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def _run(self, job: _Job) -> Any:
        """The job's compiled grammar (deserialised here), or GrammarError; the process is killed
        (and started afresh for the next job) at the deadline or when the job is cancelled."""
        if job.cancelled.is_set():
            raise _Stopped
        if self.process is None or not self.process.is_alive():
            self._stop_process()
            self._start_process()
        kind, conn = job.params.kind, self.process.conn
        try:
            conn.send(job.params)
            deadline = time.monotonic() + self.pool.timeout_s
            while not conn.poll(0.02):
                if job.cancelled.is_set():
                    raise _Stopped
                if not self.process.is_alive() and not conn.poll(0):
                    raise GrammarError(f"structured_outputs.{kind}: the grammar compiler failed "
                                       f"(exit status {self.process.exitcode})")
                if time.monotonic() > deadline:
                    self.pool.num_timeouts += 1
                    raise GrammarError(f"structured_outputs.{kind}: not compiled within {self.pool.timeout_s:g} s "
                                       "(--grammar-compile-timeout); use a simpler constraint")
            status, payload = conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self._stop_process()
            raise GrammarError(f"structured_outputs.{kind}: the grammar compiler failed") from None
        except BaseException:
            self._stop_process()  # a compile nobody waits for any more: only killing stops it
            raise
        if status == "error":
            raise GrammarError(payload)
        return _xgr().CompiledGrammar.deserialize_json(payload, self.pool.manager.tokenizer_info())


class IsolatedCompiler:
    """Compiles constraints for `manager` in worker processes; `compile` is awaited on the event loop."""

    def __init__(self, manager: StructuredOutputManager, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 num_workers: int | None = None, max_queued_per_client: int = DEFAULT_MAX_QUEUED_PER_CLIENT,
                 compile_quick_here: bool = True) -> None:
        self.manager, self.timeout_s = manager, timeout_s
        self.num_workers = num_workers or default_num_workers()
        self.max_queued_per_client = max_queued_per_client
        self.num_timeouts = 0
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # client -> its queued jobs; front: next turn
        self._workers: list[_Worker] = []  # started with the first compile
        self._info_json: str | None = None
        self._closed = False
        self._local = ThreadPoolExecutor(max_workers=1, thread_name_prefix="octavo-grammar-local",
                                         initializer=_lower_this_threads_priority)
        self._local_compiler: Any = None
        self.compile_quick_here = compile_quick_here  # small plain JSON schemas in this process (is_quick)
        self.num_local = self.num_remote = 0

    @property
    def num_compiling(self) -> int:
        """Compiles running in a worker now."""
        return sum(w.busy for w in self._workers)

    @property
    def num_queued(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    async def compile(self, params: StructuredOutputsParams, client: str = "") -> Any:
        """The compiled grammar (GrammarError: invalid, or not compiled within the deadline;
        GrammarQueueFull: `client` already queued its share). If the awaiting task is cancelled,
        the compile is dropped from the queue, or its worker killed, before the cancellation goes on."""
        if self.compile_quick_here and is_quick(params):
            self.num_local += 1
            return await asyncio.wrap_future(self._local.submit(self._compile_here, params))
        self.num_remote += 1
        job = self._submit(params, client)
        waiter = asyncio.wrap_future(job.future)
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            job.cancelled.set()
            with self._cond:
                queue = self._queues.get(client)
                if queue is not None and job in queue:
                    queue.remove(job)
                    job.future.set_exception(_Stopped())
            waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # read: never "never retrieved"
            raise

    def _compile_here(self, params: StructuredOutputsParams) -> Any:
        if self._local_compiler is None:
            xgr = _xgr()
            self._local_compiler = xgr.GrammarCompiler(self.manager.tokenizer_info(), max_threads=1, cache_enabled=False)
        start = time.monotonic()
        compiled = compile_spec(self._local_compiler, params)
        if time.monotonic() - start > QUICK_COMPILE_WARN_S:
            logger.warning("a JSON schema judged quick took %.2f s to compile in the server's process",
                           time.monotonic() - start)
        return compiled

    def close(self) -> None:
        self._local.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.set_exception(_Stopped())
            self._queues.clear()
            self._cond.notify_all()
        for worker in self._workers:
            worker.thread.join(timeout=5)

    # ---- the queue ---------------------------------------------------------------------------

    def _submit(self, params: StructuredOutputsParams, client: str) -> _Job:
        job = _Job(params, client)
        with self._cond:
            if self._closed:
                raise GrammarError(f"structured_outputs.{params.kind}: the server is shutting down")
            queue = self._queues.setdefault(client, deque())
            if len(queue) >= self.max_queued_per_client:
                raise GrammarQueueFull(f"{len(queue)} of this client's constraints are already waiting to be "
                                       "compiled; wait for them (or reuse a schema: compiled ones are cached)")
            queue.append(job)
            if not self._workers:
                self._workers = [_Worker(self, i) for i in range(self.num_workers)]
            self._cond.notify()
        return job

    def _next_job(self) -> _Job | None:
        """The next job in round-robin order over clients (blocking); None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._queues:
                    client, queue = next(iter(self._queues.items()))
                    if not queue:
                        del self._queues[client]
                        continue
                    job = queue.popleft()
                    self._queues.move_to_end(client)  # its next job waits for every other client's turn
                    if not queue:
                        del self._queues[client]
                    return job
                self._cond.wait()

    def _info(self) -> str:
        with self._cond:
            if self._info_json is None:
                self._info_json = self.manager.tokenizer_info().serialize_json()
            return self._info_json
