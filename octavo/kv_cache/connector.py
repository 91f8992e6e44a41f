"""TierConnector: the scheduler's side of the second KV tier (what it can supply, loads, stores).

Pure Python, in the shape of vLLM's KV connector (scheduler side): it says which block contents
the tier can supply, records the loads the KV-cache manager allocated pool blocks for, hands each
step's transfers to the SchedulerOutput, and applies the runner's reports. It never calls the
scheduler nor decides anything about requests: it answers for blocks, keyed by request id.

    evicted cached blocks --take_work--> stores (the tier reserves a slot)  --runner writes-->
        finish_stores: the entries become findable
    extend_cached (manager) --start_loads--> loads (the tier entry pinned, the target block held)
        --runner reads--> finish_loads: a good block enters the prefix cache, a bad one is never
        cached; per request, how many of its planned entries it keeps

A load's target block carries one reference of the connector's own until the runner reports it,
so a request preempted or ended meanwhile cannot hand the block to another while it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.groups import BlockKey
from octavo.kv_cache.tier import TierIndex
from octavo.outputs import TierReport, TierTransfer


@dataclass(slots=True)
class LoadsOfRequest:
    """One request's loads of a step: its table entries [start, start + num_planned) came from
    the cache, `loads` (table index, target block, key) of them from the tier."""

    start: int
    num_planned: int
    loads: list[tuple[int, KVCacheBlock, BlockKey]] = field(default_factory=list)


@dataclass(slots=True)
class LoadOutcome:
    """What a request keeps of a step's loads: entries [start, start + num_kept) (num_kept <
    num_planned: a load failed, the rest is void), `num_loaded` of them read from the tier (in
    some group)."""

    start: int
    num_planned: int
    num_kept: int
    num_loaded: int


class TierConnector:
    """Second-tier bookkeeping over the pool. `swap_preempted`: whether a preempted request's
    blocks go to the tier when evicted (a swap) or are let go (it recomputes them); the engine sets
    it from what it measures at start."""

    def __init__(self, index: TierIndex, pool: BlockPool) -> None:
        self.index = index
        self.pool = pool
        pool.evicted = []  # the pool records the cached contents it evicts: offered to the tier
        self.swap_preempted = True
        self._requests: dict[str, LoadsOfRequest] = {}  # this step's loads, by request
        self._loads: list[TierTransfer] = []  # this step's, until `take_work`
        self._loading: set[BlockKey] = set()  # the keys of this step's loads
        self.num_load_rounds = 0  # requests that loaded in a step, summed over steps

    # ---- reads -------------------------------------------------------------------------------

    def can_supply(self, key: BlockKey) -> bool:
        """Whether the tier holds `key` ready to read (loaded by another request this step too)."""
        return self.index.lookup(key) is not None

    def can_load(self, key: BlockKey) -> bool:
        """Whether a load of `key` may start now: ready, and not loaded by another request this
        step (waiting one step then finds it in the pool, rather than reading it twice)."""
        return self.can_supply(key) and not self.is_loading(key)

    def is_loading(self, key: BlockKey) -> bool:
        return key in self._loading

    def held_blocks(self) -> list[KVCacheBlock]:
        """Blocks this connector holds a reference on (this step's load targets)."""
        return [block for loads in self._requests.values() for _, block, _ in loads.loads]

    # ---- loads -------------------------------------------------------------------------------

    def start_loads(self, rid: str, start: int, num_planned: int, loads: list[tuple[int, KVCacheBlock, BlockKey]]) -> None:
        """Record a request's loads into the blocks the manager appended to its tables (entries
        [start, start + num_planned) came from the cache; `loads`: (table index, block, key) of
        those to read). Pins the tier entries and holds the blocks until `finish_loads`."""
        if rid in self._requests:
            raise ValueError(f"request {rid} already loads from the KV tier this step")
        self._requests[rid] = LoadsOfRequest(start, num_planned, list(loads))
        self.pool.touch([block for _, block, _ in loads])
        for _, block, key in loads:
            self._loads.append(TierTransfer(block.block_id, self.index.pin(key), key, rid))
            self._loading.add(key)
        self.num_load_rounds += 1

    def finish_loads(self, loaded: dict[int, bool]) -> dict[str, LoadOutcome]:
        """Apply the runner's report on this step's loads (pool block id -> checksum passed): a
        good block enters the prefix cache, a bad one is dropped from the tier; the held blocks
        are let go. Returns, per request that loaded, what it keeps: its entries before the first
        bad one."""
        out = {}
        for rid, req in self._requests.items():
            first_bad = req.num_planned
            for idx, block, key in req.loads:
                ok = loaded.get(block.block_id, False)
                self.index.unpin(key, ok)
                if ok:
                    self.pool.cache_block(block, key)
                else:
                    first_bad = min(first_bad, idx - req.start)
            num_loaded = len({idx for idx, _, _ in req.loads if idx - req.start < first_bad})  # entries, over groups
            self.pool.free([block for _, block, _ in req.loads][::-1])
            out[rid] = LoadOutcome(req.start, req.num_planned, first_bad, num_loaded)
        self._requests.clear()
        self._loading.clear()
        return out

    # ---- stores ------------------------------------------------------------------------------

    def take_work(self) -> tuple[list[TierTransfer], list[TierTransfer]]:
        """(stores, loads) for this step's SchedulerOutput, forgotten here: every cached block the
        pool evicted since the last call that the tier takes (a slot reserved), and the loads
        started."""
        stores = []
        for block_id, key in self.pool.evicted:
            slot = self.index.reserve(key)
            if slot is not None:
                stores.append(TierTransfer(block_id, slot, key))
        self.pool.evicted.clear()
        loads, self._loads = self._loads, []
        return stores, loads

    def finish_stores(self, stored: list[tuple[int, bool]]) -> None:
        """Apply the runner's report on finished writes: (slot, written)."""
        for slot, ok in stored:
            self.index.commit(slot, ok)

    def flush_plan(self) -> list[TierTransfer]:
        """Every block cached in the pool that the tier lacks, with a slot reserved for it: what
        a server writes at shutdown, so that a restart finds what it served last."""
        out = []
        for key, block in self.pool.cached.items():
            slot = self.index.reserve(key)
            if slot is not None:
                out.append(TierTransfer(block.block_id, slot, key))
        return out

    def let_preempted_go(self, blocks: list[KVCacheBlock]) -> None:
        """A preempted request's blocks just freed: unless preempted requests swap, their content
        is not offered to the tier when evicted (the request recomputes it)."""
        if not self.swap_preempted:
            self.pool.skip_offload.update(b.block_id for b in blocks if b.ref_cnt == 0)

    def report(self) -> TierReport:
        index = self.index
        return TierReport(index.num_slots, index.usage(), index.stats.num_stored, index.stats.num_loaded,
                          index.stats.num_corrupt, self.num_load_rounds)

    def check_invariants(self) -> list[str]:
        return self.index.check_invariants()
