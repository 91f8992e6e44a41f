"""Debug routes (only with --enable-debug-endpoints): the KV-cache state, checked on the engine
thread, and the compiled-grammar cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from octavo.server.core import OpenAIServer


def kv_cache_report(engine: Any) -> dict:
    """Pool counts and the invariant check of the engine's KV-cache manager (run between steps)."""
    kv = engine.scheduler.kv_cache
    return {
        "num_blocks": kv.num_blocks,
        "num_free_blocks": kv.num_free_blocks,
        "num_cached_blocks": len(kv.pool.cached),
        "num_running": len(engine.scheduler.running),
        "num_waiting": engine.scheduler.num_waiting,
        "problems": kv.check_invariants(),
    }


def add_debug_routes(app: FastAPI, server: OpenAIServer) -> None:
    if not server.limits.enable_debug_endpoints:
        return

    @app.get("/debug/kv_cache")
    async def kv_cache() -> dict:
        return await server.engine.call(kv_cache_report)

    @app.get("/debug/grammars")
    async def grammars() -> dict:
        return {**server.engine.grammar_cache.stats(), "num_compiling": server.grammars.num_compiling,
                "num_queued": server.grammars.num_queued, "num_compiled_here": server.grammars.num_local,
                "num_compiled_in_workers": server.grammars.num_remote,
                "num_compile_timeouts": server.grammars.num_timeouts}
