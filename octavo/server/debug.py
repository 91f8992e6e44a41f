"""Debug routes (only with --enable-debug-endpoints): the KV-cache state, checked on the engine
thread, and the compiled-grammar cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from octavo.server.core import OpenAIServer


def add_debug_routes(app: FastAPI, server: OpenAIServer) -> None:
    if not server.limits.enable_debug_endpoints:
        return

    @app.get("/debug/kv_cache")
    async def kv_cache() -> dict:
        return await server.engine.kv_cache_report()

    @app.get("/debug/grammars")
    async def grammars() -> dict:
        return {**server.engine.grammar_cache.stats(), "num_compiling": server.grammars.num_compiling,
                "num_queued": server.grammars.num_queued, "num_compiled_here": server.grammars.num_local,
                "num_compiled_in_workers": server.grammars.num_remote,
                "num_compile_timeouts": server.grammars.num_timeouts}
