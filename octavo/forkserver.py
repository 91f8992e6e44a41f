"""The one forkserver the server's worker processes (grammar compiles, chat-template renders) are
forked from: it starts once, with what either kind of worker imports already loaded, so a worker
costs a fork, not an interpreter start. `WorkerProcess` is one such worker and its pipe."""

from __future__ import annotations

import multiprocessing
from typing import Any

_PRELOAD = ["octavo.structured.isolated", "octavo.structured.manager", "xgrammar", "jsonschema",
            "octavo.chat_template.isolated", "octavo.chat_template.sandbox", "jinja2", "jinja2.sandbox"]


def forkserver_context() -> Any:
    """multiprocessing's forkserver context with the workers' modules preloaded (set before the
    forkserver's first start; later calls change nothing)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WorkerProcess:
    """A worker forked from the forkserver, running `target(conn, *args)`, and this side's end of
    its pipe; `stop` kills it (nothing else stops a compile or a render mid-way)."""

    def __init__(self, target: Any, args: tuple, name: str) -> None:
        ctx = forkserver_context()
        self.conn, theirs = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=target, args=(theirs, *args), daemon=True, name=name)
        self.process.start()
        theirs.close()

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
