"""KVCacheManager: the only KV-cache API the scheduler calls; coordinates one manager per KV group.

KV groups: layers grouped by attention kind, each group the same number of layers (see
config.kv_groups), so one pool block holds block_size tokens of any one group. Each group's tables
are kept by its own manager (kv_cache/groups.py: full attention, sliding window); this class adds
up their needs before anything is taken, so a step's allocation happens in every group or in none,
and owns what spans groups: the request's chained block hashes, the prefix-cache statistics,
blocks being computed this step, and two rooms of its own: the pinned prefixes (pins.py) and the
second tier's connector (connector.py).

Invariants (KVCacheView.check_invariants): every block is either in the free queue (ref_cnt 0) or
held; a block's ref_cnt equals the number of table entries that hold it, plus pins and the
connector's loads in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from octavo.kernels.row_paths import tiled_prompt_tokens
from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.connector import TierConnector
from octavo.kv_cache.events import MEDIUM_POOL, BlockInfo, KVEventLog
from octavo.kv_cache.groups import NULL_BLOCK_ID, BlockKey, GroupManager, kind_of, make_group
from octavo.kv_cache.pins import PinnedPrefixes
from octavo.kv_cache.prefix_cache import InFlightHashes, extend_block_hashes, root_hash
from octavo.kv_cache.tier import TierIndex
from octavo.kv_cache.view import KVCacheView
from octavo.outputs import PrefixCacheStats
from octavo.request import Request

__all__ = ["NULL_BLOCK_ID", "Allocation", "ComputedBlocks", "KVCacheManager"]

RECENT_WINDOW_FREED = 256  # window-freed block ids kept for the dashboard


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: per KV group, the shared blocks of its first `num_blocks` table entries
    (None where the group needs no block: a window passed it). Empty lists: no hit."""

    groups: list[list[KVCacheBlock | None]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size

    def num_free(self) -> int:
        """The hit's blocks that sit in the free queue (taking them takes free blocks)."""
        return sum(1 for hit in self.groups for b in hit if b is not None and b.ref_cnt == 0)


@dataclass(slots=True)
class Allocation:
    """What the scheduler learns from a successful `allocate_slots`: the request's block table in
    every KV group (NULL_BLOCK_ID where a group holds no block; read-only for the caller), and the
    (src_block_id, dst_block_id) pairs the runner copies before this step's forward: copy-on-write
    of a partly filled block shared with a sibling sequence."""

    block_tables: list[list[int]]
    copies: list[tuple[int, int]]


class KVCacheManager:
    """Keeps each request's block tables (one per KV group, through the group managers) and block
    hashes on top of a BlockPool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,), tier: TierIndex | None = None,
        group_kinds: tuple[str, ...] | None = None, prompt_tiles: bool = False, hash_algo: str = "sha256",
    ) -> None:
        """`tier`: the second KV tier's index (needs prefix caching): cached blocks the pool
        evicts are offered to it, and running requests take their next blocks from it.
        `prompt_tiles`: whether the runner computes long prompts through the int8 mode's tiles
        (kernels/row_paths.py); block hashes then say which rows the tiles computed.
        `hash_algo`: how block hashes are made (prefix_cache.py: sha256 or sha256_cbor)."""
        if tier is not None and not enable_prefix_caching:
            raise ValueError("a second KV tier holds prefix-cache blocks: it needs prefix caching on")
        if not group_windows:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prompt_tiles = prompt_tiles
        self.hash_algo = hash_algo
        self._root_hash = root_hash(hash_algo)
        self.events: KVEventLog | None = None  # recording KV events (enable_events)
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.groups: list[GroupManager] = [
            make_group(g, kind_of(w, kind), self.pool, block_size, w)
            for g, (w, kind) in enumerate(zip(self.group_windows, group_kinds or ("attention",) * len(group_windows)))]
        self.connector = TierConnector(tier, self.pool) if tier is not None else None
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._in_flight = InFlightHashes()
        self.stats = PrefixCacheStats()
        self.pins = PinnedPrefixes(self.pool, self.groups, self.block_hashes)
        # Blocks windows gave back (a count since start, and the last few ids, bounded): what the
        # dashboard draws as a local layer's blocks freed while its request runs on.
        self.num_window_freed = 0
        self.recent_window_freed: deque[int] = deque(maxlen=RECENT_WINDOW_FREED)

    # ---- reads -------------------------------------------------------------------------------

    @property
    def tier(self) -> TierIndex | None:
        """The second tier's index (read it; the connector changes it)."""
        return None if self.connector is None else self.connector.index

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def usage(self) -> float:
        return self.pool.usage()

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group (NULL_BLOCK_ID where a group holds none); [] if none."""
        tables = [g.tables.get(request_id) for g in self.groups]
        return [] if tables[0] is None else [t.ids for t in tables]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_to_admit(self, request: Request, num_new_tokens: int, computed: ComputedBlocks) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens, computed)` takes for a waiting
        request (no table yet): its new blocks, and the hit's blocks that sit in the free queue."""
        start = computed.num_tokens(self.block_size)
        hits = computed.groups or [[] for _ in self.groups]
        return sum(g.num_blocks_needed(request.request_id, start, start + num_new_tokens, hit)
                   for g, hit in zip(self.groups, hits))

    def num_blocks_to_hold(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most, over every group."""
        return sum(g.num_blocks_to_hold(num_tokens, max_chunk) for g in self.groups)

    def block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of the request's full blocks (made once, extended as it grows)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                hashes, request.all_token_ids, self.block_size, request.cache_salt, request.lora_cache_key,
                tiled_prompt_tokens(request.num_prompt_tokens, self.prompt_tiles), self.hash_algo, self._root_hash,
                None if self.events is None else _describer(self.events, request.lora_id),
            )
        return hashes

    def enable_events(self) -> KVEventLog:
        """Start recording KV events (kv_cache/events.py): an AllBlocksCleared, then what the pool
        and the tier hold now as stored, then every change. Returns the log (drain it each step)."""
        tier = self.tier
        capacity = 2 * (self.num_blocks + (tier.num_slots if tier is not None else 0)) + 1024
        log = self.events = KVEventLog(self.block_size, capacity)
        log.record_cleared()
        self.pool.changes = log.changes
        log.record_stored(MEDIUM_POOL, self.pool.cached)
        if tier is not None:
            tier.changes = log.changes
            log.record_stored(tier.medium, tier.ready_keys())
        return log

    def num_lookup_blocks(self, request: Request) -> int:
        """The blocks a prefix lookup may hit: every full block before the last token (none when
        caching is off, or for prompt logprobs and mean / cls embeddings, which need every prompt
        position computed, as vLLM v1 does)."""
        params = request.sampling_params
        if (not self.enable_prefix_caching or params.prompt_logprobs is not None
                or (params.pooling is not None and params.pooling.needs_every_position)):
            return 0
        return (request.num_tokens - 1) // self.block_size

    def is_in_pool(self, key: BlockKey) -> bool:
        return self.pool.lookup(key) is not None

    def is_cached(self, key: BlockKey) -> bool:
        """In the pool or, ready to load, in the second tier."""
        return self.is_in_pool(key) or (self.connector is not None and self.connector.can_supply(key))

    def reach(self, hashes: list[bytes], start: int, end: int, available: Callable[[BlockKey], bool]) -> int:
        """The longest run of table entries [start, n), n <= end, every group can take from the
        cache (`available`): each group shortens it until it holds (a fixed point: a window's
        answer is not monotone in n, a global group's is)."""
        n = end
        while True:
            m = n
            for g in self.groups:
                m = g.hit_length(hashes, start, m, available)
            if m == n:
                return n
            n = m

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request that every group can serve; changes nothing. The
        hit never covers the last token: its logits must be computed, so a request whose whole
        prompt is cached still recomputes its last block."""
        hashes = self.block_hashes(request)[: self.num_lookup_blocks(request)]
        num_hit = self.reach(hashes, 0, len(hashes), self.is_in_pool)
        if num_hit == 0:
            return ComputedBlocks()
        return ComputedBlocks([g.hit_blocks(hashes, 0, num_hit) for g in self.groups])

    def num_hit_blocks_with_tier(self, request: Request, supply: Callable[[BlockKey], bool]) -> int:
        """The prefix hit (blocks) the pool and `supply` (the second tier) serve together.
        Changes nothing."""
        hashes = self.block_hashes(request)[: self.num_lookup_blocks(request)]
        return self.reach(hashes, 0, len(hashes), lambda key: self.is_in_pool(key) or supply(key))

    def is_prefix_in_flight(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether the block right after the hit is being computed by another request this step
        (so waiting one step turns it into a hit)."""
        if not self._in_flight:
            return False
        hashes = self.block_hashes(request)
        idx = computed.num_blocks
        return idx < min(len(hashes), (request.num_tokens - 1) // self.block_size) and hashes[idx] in self._in_flight

    # ---- writes ------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Grow the request's tables so tokens [start, start + num_new_tokens) have slots in
        every group.

        start is request.num_computed_tokens, or the hit's length when `computed` is given (a
        request being admitted, whose tables must be empty). First, groups give back the blocks
        wholly before what a query at `start` reads (a window's passed blocks; a cached one
        stays findable until evicted). Then returns None, changing nothing more, when the pool
        cannot supply every group's blocks. Nothing is entered into the prefix cache here: a
        block becomes shareable only once its tokens are computed (`cache_blocks`, after the
        step), so a request preempted after being scheduled leaves no hash on unwritten KV.

            table:  | gone | full | part |  new  |  new  |
                                  ^start        ^start + num_new_tokens
            a shared `part` block is copied first (copy-on-write); full blocks are never copied.
        """
        rid = request.request_id
        if computed is not None and computed.num_blocks and rid in self.groups[0].tables \
                and self.groups[0].tables[rid].blocks:
            raise ValueError(f"request {rid} already holds blocks; a prefix hit applies only on admission")
        hits = computed.groups if computed is not None and computed.groups else [[] for _ in self.groups]
        start = computed.num_tokens(self.block_size) if computed is not None else request.num_computed_tokens
        end = start + num_new_tokens
        for g in self.groups:
            self._note_window_freed(g.drop_passed(rid, start))
        if sum(g.num_blocks_needed(rid, start, end, hit) for g, hit in zip(self.groups, hits)) > self.pool.num_free_blocks:
            return None
        if computed is not None:
            self.stats.num_queries_tokens += request.num_tokens
            self.stats.num_hits_tokens += computed.num_tokens(self.block_size)
            self._num_cached_blocks[rid] = max(self._num_cached_blocks.get(rid, 0), computed.num_blocks)
        for g, hit in zip(self.groups, hits):  # every group's hits leave the free queue before any
            g.take_hit(rid, hit)  # allocation can evict them
        copies = [copy for g in self.groups if (copy := g.grow(rid, start, end)) is not None]
        self._mark_in_flight(request, end)
        return Allocation([g.tables[rid].ids for g in self.groups], copies)

    def _note_window_freed(self, gone: list[KVCacheBlock]) -> None:
        self.num_window_freed += len(gone)
        self.recent_window_freed.extend(b.block_id for b in gone if b.ref_cnt == 0)

    def _mark_in_flight(self, request: Request, end: int) -> None:
        if self.enable_prefix_caching:
            rid = request.request_id
            first = max(self._num_cached_blocks.get(rid, 0), self._in_flight.num_marked(rid))
            self._in_flight.mark(rid, self.block_hashes(request)[first : end // self.block_size])

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within its first `num_computed_tokens` tokens
        into the prefix cache, in every group that still holds them. Call only once the forward
        has written those tokens' KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        self._in_flight.clear(rid)
        if rid not in self.groups[0].tables:
            return
        num_full = min(num_computed_tokens // self.block_size, len(self.groups[0].tables[rid].blocks))
        first = self._num_cached_blocks.get(rid, 0)
        if num_full <= first:
            return
        hashes = self.block_hashes(request)
        for g in self.groups:
            g.cache(rid, hashes, first, num_full)
        self._num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks wholly past its first `num_tokens` tokens (in every
        group, tail first): speculative slots whose drafts were rejected. Their KV is never
        entered into the prefix cache (`cache_blocks` stops at the accepted tokens) and the next
        step allocates afresh. Returns the number of table entries dropped."""
        keep = self.num_blocks_for(num_tokens)
        return sum(g.trim(request.request_id, keep) for g in self.groups)

    def fork(self, parent: Request, child: Request) -> list[list[int]]:
        """Give `child` the parent's whole tables by reference (ref counts +1); returns its tables."""
        for g in self.groups:
            g.fork(parent.request_id, child.request_id)
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)
        return self.block_tables(child.request_id)

    def free(self, request: Request, preempted: bool = False) -> None:
        """Return all the request's blocks (tail of each table first, so chains evict tail-first).

        The block hashes are kept: a preempted request recomputes the same tokens and can hit
        its own cached prefix. `remove` forgets them once the request has ended. A `preempted`
        request's blocks go to the second tier when evicted only if its connector swaps them.
        """
        rid = request.request_id
        self._in_flight.clear(rid)
        self._num_cached_blocks.pop(rid, None)
        for g in self.groups:
            held = g.free(rid)
            if preempted and self.connector is not None:
                self.connector.let_preempted_go(held)

    def remove(self, request: Request) -> None:
        """Free the request's blocks and forget everything kept about it."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block of the pool and of the second tier, but the pinned prefixes'.
        Returns how many."""
        num_forgotten = self.pool.reset_prefix_cache() + (self.tier.clear() if self.tier is not None else 0)
        if self.events is not None:  # a subscriber forgets everything, then learns what a reset keeps
            self.events.record_cleared()
            if self.tier is not None:
                self.events.record_stored(self.tier.medium, self.tier.ready_keys())
        self.pins.restore_hashes()
        return num_forgotten - self.pins.num_blocks

    # ---- running requests taking their next blocks from the cache (with a second tier) --------

    def num_cached_ahead(self, request: Request, max_blocks: int, supply: Callable[[BlockKey], bool]) -> int:
        """How many of the request's next table entries every group can take from the pool or
        from `supply` (the tier) rather than compute: 0 unless it stands at a block boundary with
        tables that long; at most `max_blocks`, never its last token's block. Changes nothing."""
        bs, rid = self.block_size, request.request_id
        if request.num_computed_tokens % bs or rid not in self.groups[0].tables:
            return 0
        start = request.num_computed_tokens // bs
        if any(len(g.tables[rid].blocks) != start for g in self.groups):
            return 0
        end = min(self.num_lookup_blocks(request), start + max_blocks)
        if end <= start:  # decoding, or nothing left before the last token: compute on
            return 0
        hashes = self.block_hashes(request)
        return self.reach(hashes, start, end, lambda key: self.is_in_pool(key) or supply(key)) - start

    def extend_cached(self, request: Request, max_blocks: int, supply: Callable[[BlockKey], bool]
                      ) -> tuple[int, list[tuple[int, KVCacheBlock, BlockKey]]] | None:
        """Take the request's next table entries from the cache (`num_cached_ahead`, fewer when
        the pool cannot spare what they take): pool blocks shared at once, the others allocated
        for loads from `supply` (returned as (table index, block, key): the caller starts them).
        A group's entries its window passes are None. Returns (entries taken, loads); (0, [])
        when nothing is cached ahead; None, changing nothing, when the next entry is cached but
        the pool cannot spare its blocks (the caller frees some, as for a chunk)."""
        rid, bs = request.request_id, self.block_size
        num = self.num_cached_ahead(request, max_blocks, supply)
        if num == 0:
            return 0, []
        start = request.num_computed_tokens // bs
        hashes = self.block_hashes(request)
        available = lambda key: self.is_in_pool(key) or supply(key)  # noqa: E731
        while num > 0:
            plans = [g.ahead(hashes, start, start + num) for g in self.groups]
            if sum(cost for _, cost in plans) <= self.pool.num_free_blocks:
                break
            num = self.reach(hashes, start, start + num - 1, available) - start
        if num == 0:
            return None
        for g, (entries, _) in zip(self.groups, plans):  # shared blocks leave the free queue before any allocation
            g.take_hit(rid, entries)
        loads = [load for g in self.groups for load in g.load_targets(rid, hashes, start, start + num)]
        if not loads:
            self.note_extended(request, start, num, 0)
        return num, loads

    def note_extended(self, request: Request, start: int, num_kept: int, num_loaded: int) -> None:
        """Count the entries a running request took from the cache as prefix hits (they are
        cached already: never entered again)."""
        self.stats.num_hits_tokens += num_kept * self.block_size
        self.stats.num_tier_hits_tokens += num_loaded * self.block_size
        rid = request.request_id
        self._num_cached_blocks[rid] = max(self._num_cached_blocks.get(rid, 0), start + num_kept)

    def roll_back(self, request: Request, num_blocks: int) -> int:
        """A load failed: cut the request's tables to their first `num_blocks` entries, or fewer
        where a group's window would read an entry it skipped; returns the entries kept, which
        the request stands at (computed). The step's chunk after them is void."""
        rid = request.request_id
        while num_blocks > 0 and any(
                None in g.tables[rid].blocks[g.first_needed_block(num_blocks * self.block_size) : num_blocks]
                for g in self.groups):
            num_blocks -= 1
        for g in self.groups:
            g.trim(rid, num_blocks)
        self._in_flight.clear(rid)
        return num_blocks

    def view(self) -> KVCacheView:
        """A read-only view of the pool, the tables and the tier now (read it before the next step)."""
        return KVCacheView(self.pool, self.groups, self.pins, self.connector, self.num_window_freed,
                           list(self.recent_window_freed))


def _describer(events: KVEventLog, lora_id: int | None) -> Callable[[bytes, bytes | None, Sequence[int], tuple | None], None]:
    """What extend_block_hashes tells each new block: the event log remembers its tokens."""
    def describe(block_hash: bytes, parent: bytes | None, tokens: Sequence[int], extra: tuple | None) -> None:
        events.describe(block_hash, BlockInfo(parent, tuple(tokens), extra, lora_id))
    return describe
