"""KVCacheView: a read-only view of the pool, the block tables and the tier at one moment.

What the dashboard, the debug route, the simulator's replay and tests read instead of the
manager's insides. Built between steps (KVCacheManager.view()); it holds references, so read it
before the next step changes the cache.
"""

from __future__ import annotations

from octavo.kv_cache.block_pool import BlockPool
from octavo.kv_cache.connector import TierConnector
from octavo.kv_cache.groups import GroupManager
from octavo.kv_cache.pins import PinnedPrefixes


class KVCacheView:
    """Reads only. Block states, one character per pool block: f free (no cached content),
    c cached (ref 0, findable by hash), u in use by one request, s shared by several, p pinned."""

    def __init__(self, pool: BlockPool, groups: list[GroupManager], pins: PinnedPrefixes,
                 connector: TierConnector | None, num_window_freed: int, recent_window_freed: list[int]) -> None:
        self._pool, self._groups, self._pins, self._connector = pool, groups, pins, connector
        self.num_blocks = pool.num_blocks
        self.num_free_blocks = pool.num_free_blocks
        self.num_cached_blocks = len(pool.cached)
        self.block_size = groups[0].block_size
        self.group_windows = tuple(g.window for g in groups)
        self.num_window_freed = num_window_freed  # blocks windows gave back since start
        self.recent_window_freed = recent_window_freed  # the latest of them, oldest first

    def live_request_ids(self) -> list[str]:
        """The requests that hold block tables (running, or preempted mid-step until freed)."""
        return list(self._groups[0].tables)

    def table_entries(self, request_id: str) -> list[list[int | None]]:
        """The request's block ids per group, None where its group gave the block back (unlike
        `block_tables`, whose placeholder id is a real block's too). A fresh list: O(table)."""
        return [[None if b is None else b.block_id for b in g.tables[request_id].blocks]
                for g in self._groups if request_id in g.tables]

    def held_blocks(self, request_id: str) -> list[int]:
        """Every block the request holds, over all groups (NULL entries left out)."""
        return [b.block_id for g in self._groups if request_id in g.tables for b in g.tables[request_id].held()]

    def block_position(self, request_id: str, block_id: int) -> int | None:
        """Where the request's tables hold block `block_id` (its index in its group's table), or None."""
        for g in self._groups:
            table = g.tables.get(request_id)
            for idx, block in enumerate(table.blocks if table else ()):
                if block is not None and block.block_id == block_id:
                    return idx
        return None

    def block_states(self) -> str:
        states = ["u" if b.ref_cnt == 1 else "s" if b.ref_cnt else "f" if b.block_hash is None else "c"
                  for b in self._pool.blocks]
        for block_id in self._pins.block_ids():
            states[block_id] = "p"
        return "".join(states)

    def tier_slot_states(self) -> str | None:
        """The second tier's slots (TierIndex.slot_states), or None without a tier."""
        return None if self._connector is None else self._connector.index.slot_states()

    def held_by_others(self) -> list[int]:
        """Blocks held by no request's table: pins and the connector's loads in flight (one entry
        per reference)."""
        loads = self._connector.held_blocks() if self._connector is not None else []
        return self._pins.block_ids() + [b.block_id for b in loads]

    def check_invariants(self) -> list[str]:
        """Problems found in the pool and tables (empty when sound); O(num_blocks), for tests and
        the server's debug endpoint. Checks that every block is free (in the queue once, ref 0)
        or held with ref_cnt equal to the number of holders, and that the hash map points only at
        blocks carrying that hash."""
        pool = self._pool
        problems: list[str] = []
        free_ids = pool.free_queue.block_ids()
        if len(free_ids) != len(set(free_ids)):
            problems.append("a block is in the free queue twice")
        if len(free_ids) != pool.num_free_blocks:
            problems.append(f"free queue holds {len(free_ids)} blocks but counts {pool.num_free_blocks}")
        holders: dict[int, int] = {}
        held = [b.block_id for g in self._groups for table in g.tables.values() for b in table.held()]
        for block_id in held + self.held_by_others():
            holders[block_id] = holders.get(block_id, 0) + 1
        free_set = set(free_ids)
        for block in pool.blocks:
            num = holders.get(block.block_id, 0)
            if block.ref_cnt != num:
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {num} tables")
            if (block.ref_cnt == 0) != (block.block_id in free_set):
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block.block_id in free_set}")
        for key, block in pool.cached.items():
            if block.block_hash != key:
                problems.append(f"hash map entry points at {block} with another hash")
        if self._connector is not None:
            problems += self._connector.check_invariants()
        return problems
