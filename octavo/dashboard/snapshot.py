"""Dashboard snapshots: what the KV pool, the requests and the last steps look like now, as plain
data built between steps on the engine thread (pure Python: the scheduler's and the KV-cache
manager's own state, read, never written).

Block states, one character per block of the pool:
    f  free: ref 0, no cached content
    c  cached: ref 0, its content findable by hash (evicted when the pool needs it)
    u  in use by one request          s  shared: held by several (prefix hits, n > 1 forks)
    p  pinned (a pinned prefix's block: never evicted)
A pool larger than `max_cells` blocks is shown in cells of several blocks each (a cell takes the
liveliest state among its blocks).

Models with sliding-window layers page each KV group apart: a held block belongs to one group
(`pool.groups`), a request has a block table per group, and a window's group gives blocks back as
its request advances (`None` in the table; `pool.window_freed` counts them and lists the latest).

The second KV tier's slots, one character each (aggregated the same way):
    .  empty    w  being written (a block the pool evicted, on its way)
    r  ready (found by prefix lookups)    l  being read back into the pool (a load in flight)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from octavo.kv_cache.view import KVCacheView
from octavo.outputs import SpecDecodeStats, StepLog

MAX_CELLS = 4096  # block cells a snapshot carries at most (past that, cells aggregate blocks)
MAX_REQUESTS = 64  # running and waiting requests listed at most (the rest counted)
MAX_TABLE = 128  # block-table entries listed per request and group at most (the latest)
RECENT_FREED = 64  # window-freed block ids a snapshot lists at most


def block_holders(view: KVCacheView, tables: dict[str, list[list[int | None]]]) -> tuple[dict[int, list[str]], dict[int, int]]:
    """(block id -> the live sequence ids holding it, block id -> the KV group holding it: filled
    only where the model has several groups). `tables`: every live sequence's `table_entries`."""
    holders: dict[int, list[str]] = {}
    groups: dict[int, int] = {}
    multi_group = len(view.group_windows) > 1
    for rid, entries in tables.items():
        for g, table in enumerate(entries):
            for block_id in table:
                if block_id is not None:
                    holders.setdefault(block_id, []).append(rid)
                    if multi_group:
                        groups[block_id] = g
    return holders, groups


_PRECEDENCE = "supcf"  # an aggregated cell shows the liveliest state among its blocks
_TIER_PRECEDENCE = "lwr."  # a tier cell: a load, a write, ready, empty


def aggregate(states: str, max_cells: int, precedence: str = _PRECEDENCE) -> tuple[str, int]:
    """States in cells of ceil(n / max_cells) blocks, each cell the liveliest state among its
    blocks, `precedence` listing them liveliest first (in the pool: shared, in use, pinned,
    cached, free: a busy block is never hidden by idle ones)."""
    per_cell = max(1, -(-len(states) // max_cells))
    if per_cell == 1:
        return states, 1
    ranks = "".join(chr(48 + i) for i in range(len(precedence)))
    ranked = states.translate(str.maketrans(precedence[::-1], ranks))
    ranked += "0" * (-len(ranked) % per_cell)  # padding of the idlest rank: never wins a cell
    # cell c is max(ranked[c * k], ..., ranked[c * k + k - 1]): k strided strings compared in step
    cells = "".join(map(max, *(ranked[j::per_cell] for j in range(per_cell))))
    return cells.translate(str.maketrans(ranks, precedence[::-1])), per_cell


def _table_view(entries: list[int | None]) -> dict[str, Any]:
    """One group's table as the page lists it: its latest MAX_TABLE entries (None: given back by
    the window) and how many earlier ones are left out."""
    skipped = max(0, len(entries) - MAX_TABLE)
    return {"skipped": skipped, "ids": entries[skipped:]}


def _request_row(request: Any, tables: list[list[int | None]], index: dict[str, int]) -> dict[str, Any]:
    """One request as the page lists it; `tables` its `table_entries` (empty while it waits)."""
    held = [sum(1 for b in t if b is not None) for t in tables]
    return {
        "id": request.user_request_id,
        "seq": request.request_id,
        "color": index.setdefault(request.request_id, len(index)),
        "status": request.status.value,
        "prompt": request.num_prompt_tokens,
        "computed": request.num_computed_tokens,
        "cached": request.num_cached_tokens or 0,
        "output": request.num_output_tokens,
        "max_tokens": request.sampling_params.max_tokens,
        "preemptions": request.num_preemptions,
        "priority": request.priority,
        "tables": [_table_view(t) for t in tables],  # one per KV group
        "num_blocks": sum(held),
        # per KV group (sliding-window layers page apart): [blocks held, blocks its window gave back]
        "groups": [[h, len(t) - h] for h, t in zip(held, tables)] if len(tables) > 1 else None,
    }


def _pool_view(kv: KVCacheView, states: str, holders: dict[int, list[str]], groups: dict[int, int], index: dict[str, int],
               max_cells: int) -> dict[str, Any]:
    """The pool grid: cells, per-cell owner (colour index of the first holder listed) and KV
    group (-1 where none; both None once cells aggregate blocks), holders of shared blocks,
    counts, window frees."""
    cells, per_cell = aggregate(states, max_cells)
    owners = [-1] * len(cells) if per_cell == 1 else None  # aggregated cells are drawn by state alone
    cell_groups = [-1] * len(cells) if groups and per_cell == 1 else None
    if per_cell == 1:
        for block_id, rids in holders.items():
            owners[block_id] = index.get(rids[0], -1)
        for block_id, g in groups.items():
            cell_groups[block_id] = g
    counts = {c: states.count(c) for c in _PRECEDENCE}
    recent = list(kv.recent_window_freed)[-RECENT_FREED:]
    return {
        "num_blocks": kv.num_blocks, "block_size": kv.block_size, "cells": cells, "blocks_per_cell": per_cell,
        "owners": owners, "groups": cell_groups,
        "num_shared_owners": {str(b): len(r) for b, r in holders.items() if len(r) > 1 and per_cell == 1},
        "counts": {"free": counts["f"], "cached": counts["c"], "used": counts["u"], "shared": counts["s"],
                   "pinned": counts["p"]},
        "windows": list(kv.group_windows),
        # blocks sliding windows gave back: how many since start, and the latest ids (the page
        # marks those given back since its previous snapshot)
        "window_freed": {"total": kv.num_window_freed, "recent": recent},
    }


def _tier_view(states: str | None, stats: Any, max_cells: int) -> dict[str, Any] | None:
    """The second tier's slots (states as in the module docstring) and its counters."""
    if states is None:
        return None
    cells, per_cell = aggregate(states, max_cells, _TIER_PRECEDENCE)
    return {
        "num_slots": stats.tier.num_blocks, "usage": stats.tier.usage, "blocks_stored": stats.tier.num_stored,
        "blocks_loaded": stats.tier.num_loaded, "hits": stats.prefix.num_tier_hits_tokens, "loads": stats.tier.num_load_rounds,
        "cells": cells, "slots_per_cell": per_cell,
        "counts": {"empty": states.count("."), "writing": states.count("w"), "ready": states.count("r"),
                   "reading": states.count("l")},
    }


def build_snapshot(scheduler: Any, steps: StepLog, max_cells: int = MAX_CELLS,
                   spec: SpecDecodeStats | None = None) -> dict[str, Any]:
    """The dashboard's view of the engine now. Reads the scheduler and its KV-cache view (call it
    between steps, on the thread that steps them), and speculative decoding's counters `spec`;
    O(pool blocks + tier slots + live requests)."""
    kv = scheduler.kv_cache.view()
    tables = {rid: kv.table_entries(rid) for rid in kv.live_request_ids()}  # read once, used twice
    states = kv.block_states()
    holders, groups = block_holders(kv, tables)
    index: dict[str, int] = {}
    running = [_request_row(r, tables.get(r.request_id, []), index) for r in scheduler.running[:MAX_REQUESTS]]
    waiting = [_request_row(r, tables.get(r.request_id, []), index) for r in list(scheduler.waiting)[:MAX_REQUESTS]]
    stats = scheduler.stats()
    return {
        "time": time.time(),
        "pool": _pool_view(kv, states, holders, groups, index, max_cells),
        "running": running,
        "waiting": waiting,
        "num_running": len(scheduler.running),
        "num_waiting": scheduler.num_waiting,
        "steps": [[s.step, s.end_time, s.seconds, s.num_prefill_tokens, s.num_decode_tokens, s.num_requests,
                   s.num_preempted] for s in steps.records],
        "stats": {
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix.num_queries_tokens,
            "prefix_cache_hits": stats.prefix.num_hits_tokens,
            "num_preemptions": stats.preemption.num_preemptions,
            "num_recomputed_tokens": stats.preemption.num_recomputed_tokens,
            "spec_num_draft_tokens": spec.num_draft_tokens if spec else 0,
            "spec_num_accepted_tokens": spec.num_accepted_tokens if spec else 0,
        },
        "tier": _tier_view(kv.tier_slot_states(), stats, max_cells),
    }


def block_tokens(scheduler: Any, block_id: int) -> tuple[list[str], list[int]] | None:
    """(the sequences holding a block, the token ids it holds for the first of them), or None
    when no live sequence holds it (a free or cached block's tokens belong to nobody live)."""
    kv = scheduler.kv_cache.view()
    holders = [rid for rid in kv.live_request_ids() if kv.block_position(rid, block_id) is not None]
    if not holders or holders[0] not in scheduler.requests:
        return None
    idx = kv.block_position(holders[0], block_id)
    tokens = scheduler.requests[holders[0]].all_token_ids[idx * kv.block_size : (idx + 1) * kv.block_size]
    return holders, tokens
