"""The server's chat-template renders, in worker processes that a deadline or a memory bound stops.

A render in the server's process could not be stopped: a template looping 10^10 times held a
thread of the shared tokenize pool for hours (every chat behind it hung), and one writing
`'x' * 30000000` took the server from 831 MiB to 6.6 GiB. The sandbox's budget (sandbox.py)
catches both while rendering; what it cannot see (one C-level call that allocates before it
returns) is bounded here: each worker runs under an address-space limit (`memory_bytes` above
what it holds at start) and is killed at the deadline (plus a grace for compiling and shipping).
A worker whose render went past any bound is replaced, so its heap goes with it and the server's
memory stays where it was.

Two lanes, each with its own workers: the model's own template ("model") and templates a request
sent (--trust-request-chat-template, "request"), so a request's template can delay only other
requests' templates, never the chats that use the model's. Rendering never shares a thread with
tokenisation. A worker keeps the templates it compiled (by source, the last few).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import resource
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from octavo.chat_template.sandbox import RenderBudget, TemplateBudgetError, compile_chat_template, render_chat
from octavo.forkserver import WorkerProcess

logger = logging.getLogger("octavo.chat_template")

DEFAULT_MEMORY_BYTES = 1 << 30  # a worker may grow by this much (a real render needs a few MiB)
GRACE_S = 2.0  # past the render's deadline, for compiling the template and shipping the text
_COMPILED_KEPT = 8


@dataclass(frozen=True, slots=True)
class RenderJob:
    """One render, as sent to a worker (plain data)."""

    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    variables: dict[str, Any]
    continue_final_message: bool
    budget: RenderBudget


def _limit_memory(memory_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus `memory_bytes`."""
    try:
        with open("/proc/self/status") as f:
            mapped_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
        limit = mapped_kib * 1024 + memory_bytes
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (OSError, ValueError, StopIteration):
        logger.warning("could not limit a chat-template worker's memory")


def _worker_main(conn: Any, memory_bytes: int) -> None:
    """In a worker: answer each RenderJob with ("ok", text), ("budget", bound, message) or
    ("error", message); None or a closed pipe ends it."""
    _limit_memory(memory_bytes)
    with contextlib.suppress(OSError):
        os.nice(10)  # below the engine: a template spinning to its deadline takes only spare CPU
    compiled: OrderedDict[str, Any] = OrderedDict()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            template = compiled.get(job.source)
            if template is None:
                template = compiled[job.source] = compile_chat_template(job.source)
                if len(compiled) > _COMPILED_KEPT:
                    compiled.popitem(last=False)
            compiled.move_to_end(job.source)
            text = render_chat(template, job.messages, job.tools, job.add_generation_prompt, job.variables,
                               job.budget, job.continue_final_message)
            answer: tuple = ("ok", text)
        except TemplateBudgetError as exc:
            answer = ("budget", exc.bound, str(exc))
        except MemoryError:
            answer = ("budget", "memory", "")
        except Exception as exc:  # the template's own error (raise_exception, a syntax error, an undefined)
            answer = ("error", f"{type(exc).__name__}: {exc}" if not str(exc) else str(exc))
        try:
            conn.send(answer)
        except MemoryError:
            conn.send(("budget", "memory", ""))
        if answer[0] == "budget":
            return  # its heap may have grown: the pool starts a new worker


@dataclass(slots=True, eq=False)
class _Job:
    job: RenderJob
    future: Future = field(default_factory=Future)


class _Worker:
    """One worker process and the thread that feeds it jobs from its lane's queue."""

    def __init__(self, lane: _Lane, index: int) -> None:
        self.lane, self.index = lane, index
        self.process: Any = None
        self.thread = threading.Thread(target=self._loop, name=f"octavo-template-{lane.name}-{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        self._ensure_process()  # started before the first job: a chat does not wait for a fork
        while True:
            item = self.lane.jobs.get()
            if item is None:
                self._stop_process()
                return
            try:
                item.future.set_result(self._run(item.job))
            except BaseException as exc:
                item.future.set_exception(exc)

    def _ensure_process(self) -> None:
        if self.process is None or not self.process.is_alive():
            self._stop_process()
            self.process = WorkerProcess(_worker_main, (self.lane.memory_bytes,),
                                         f"octavo-template-{self.lane.name}-{self.index}")

    def _stop_process(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def _run(self, job: RenderJob) -> str:
        self._ensure_process()
        budget, conn = job.budget, self.process.conn
        try:
            conn.send(job)
            deadline = time.monotonic() + budget.deadline_s + GRACE_S
            while not conn.poll(0.05):
                if not self.process.is_alive() and not conn.poll(0):
                    raise self._memory_error()  # killed by the address-space limit, as far as can be told
                if time.monotonic() > deadline:
                    self.lane.num_replaced += 1
                    self._stop_process()
                    raise TemplateBudgetError("deadline", f"the chat template did not render within "
                                                          f"{budget.deadline_s:g} s (--chat-template-timeout)")
            answer = conn.recv()
        except (EOFError, OSError):
            raise self._memory_error() from None
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "budget":
            if answer[1] == "memory":
                raise self._memory_error()
            self.lane.num_replaced += 1
            self._stop_process()
            raise TemplateBudgetError(answer[1], answer[2])
        raise ValueError(answer[1])

    def _memory_error(self) -> TemplateBudgetError:
        self.lane.num_replaced += 1
        self._stop_process()
        return TemplateBudgetError("memory", f"the chat template needed more than {self.lane.memory_bytes >> 20} MiB "
                                             "to render (its memory bound)")


class _Lane:
    def __init__(self, name: str, num_workers: int, memory_bytes: int) -> None:
        self.name, self.memory_bytes = name, memory_bytes
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.num_replaced = 0
        self.workers = [_Worker(self, i) for i in range(num_workers)]

    def close(self) -> None:
        for _ in self.workers:
            self.jobs.put(None)
        for worker in self.workers:
            worker.thread.join(timeout=5)


class TemplateRenderer:
    """Renders chat templates in worker processes, one lane for the model's template and one for
    requests' (see the module's text). Workers start on the first render of their lane."""

    def __init__(self, budget: RenderBudget | None = None, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 num_model_workers: int = 2, num_request_workers: int = 1) -> None:
        self.budget = budget or RenderBudget()
        self.memory_bytes = memory_bytes
        self._sizes = {"model": num_model_workers, "request": num_request_workers}
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _lane(self, name: str) -> _Lane:
        with self._lock:
            if self._closed:
                raise RuntimeError("the chat-template renderer is closed")
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = _Lane(name, self._sizes[name], self.memory_bytes)
            return lane

    def start(self, lane: str = "model") -> None:
        """Start a lane's workers now (the server does at start), so no chat waits for a fork."""
        self._lane(lane)

    @property
    def num_replaced(self) -> int:
        """Workers replaced after a render went past a bound."""
        return sum(lane.num_replaced for lane in self._lanes.values())

    async def render(self, source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool, variables: dict[str, Any], continue_final_message: bool = False,
                     from_request: bool = False) -> str:
        """The rendered text; TemplateBudgetError past a bound, ValueError for the template's own
        error. `from_request`: the template came with the request (its own lane)."""
        job = _Job(RenderJob(source, messages, tools, add_generation_prompt, variables, continue_final_message,
                             self.budget))
        self._lane("request" if from_request else "model").jobs.put(job)
        return await asyncio.wrap_future(job.future)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            with contextlib.suppress(Exception):
                lane.close()
