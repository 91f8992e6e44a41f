"""Compiling a request's grammar in a child process, with a deadline and a way to stop it.

A compile cannot be interrupted inside xgrammar, and some are slow: a 158-character regex took ~30
CPU-seconds. Compiled in the server's process it held a thread of the shared pool the whole time
(stalling tokenisation for everyone) and kept going after its client left. Here each compile runs
in a child forked from a forkserver that has xgrammar loaded (~20 ms to start, its memory shared),
niced below the engine, at most `max_concurrent` at once; the child is killed when the deadline
passes or the caller is cancelled (its client left). The compiled grammar comes back serialised
(~1.6 MB and ~70 ms for a small schema on a 49k vocabulary) and is rebuilt here against the
server's own tokenizer info.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from octavo.sampling.params import StructuredOutputsParams
from octavo.structured.manager import GrammarError, StructuredOutputManager, _xgr, compile_spec

DEFAULT_COMPILE_TIMEOUT_S = 10.0  # a small schema takes ~15 ms, a large one ~0.5 s


class _Cancelled(Exception):
    pass


def _child(conn: Any, info_json: str, params: StructuredOutputsParams) -> None:
    """In the child: compile, send ("ok", serialised grammar) or ("error", message), exit."""
    try:
        os.nice(10)  # the engine's steps come first
    except OSError:
        pass
    xgr = _xgr()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)
    try:
        conn.send(("ok", compile_spec(compiler, params).serialize_json()))
    except GrammarError as exc:
        conn.send(("error", str(exc)))
    conn.close()


class IsolatedCompiler:
    """Compiles constraints for `manager` in child processes; `compile` is awaited on the event loop."""

    def __init__(self, manager: StructuredOutputManager, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_concurrent: int = 2) -> None:
        self.manager, self.timeout_s = manager, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="octavo-grammar-wait")
        self._info_json: str | None = None
        self._lock = threading.Lock()
        self._children: set[Any] = set()
        self.num_timeouts = 0

    @property
    def num_compiling(self) -> int:
        """Child processes compiling now."""
        with self._lock:
            return sum(1 for c in self._children if c.is_alive())

    async def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (GrammarError: invalid, or not compiled within the deadline). If the
        awaiting task is cancelled, the child is killed before the cancellation goes on."""
        cancel = threading.Event()
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._compile_blocking, params, cancel)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when nobody awaits it
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _info(self) -> str:
        with self._lock:
            if self._info_json is None:
                self._info_json = self.manager.tokenizer_info().serialize_json()
            return self._info_json

    def _compile_blocking(self, params: StructuredOutputsParams, cancel: threading.Event) -> Any:
        if cancel.is_set():  # its client left while it queued
            raise _Cancelled
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["octavo.structured.isolated", "xgrammar"])
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(sender, self._info(), params), daemon=True,
                            name="octavo-grammar-compile")
        child.start()
        sender.close()
        with self._lock:
            self._children.add(child)
        deadline = time.monotonic() + self.timeout_s
        try:
            while not receiver.poll(0.05):
                if cancel.is_set():
                    raise _Cancelled
                if not child.is_alive() and not receiver.poll(0):
                    raise GrammarError(f"structured_outputs.{params.kind}: the grammar compiler failed "
                                       f"(exit status {child.exitcode})")
                if time.monotonic() > deadline:
                    self.num_timeouts += 1
                    raise GrammarError(f"structured_outputs.{params.kind}: not compiled within {self.timeout_s:g} s "
                                       "(--grammar-compile-timeout); use a simpler constraint")
            try:
                status, payload = receiver.recv()
            except EOFError:
                raise GrammarError(f"structured_outputs.{params.kind}: the grammar compiler failed") from None
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            receiver.close()
            with self._lock:
                self._children.discard(child)
        if status == "error":
            raise GrammarError(payload)
        return _xgr().CompiledGrammar.deserialize_json(payload, self.manager.tokenizer_info())
