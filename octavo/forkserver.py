"""The one forkserver the server's worker processes (grammar compiles, chat-template renders) are
forked from: it starts once, with what either kind of worker imports already loaded, so a worker
costs a fork, not an interpreter start."""

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
