"""KVCacheManager: the only KV-cache API the scheduler calls (block tables, prefix hits, forks, CoW)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from octavo.config import blocks_to_hold
from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.prefix_cache import extend_block_hashes
from octavo.kv_cache.tier import TierIndex, TierKey
from octavo.outputs import TierTransfer
from octavo.request import Request


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: per KV group, the shared blocks of its first `num_blocks` table entries
    (None where a sliding-window group needs no block: wholly before the window of the next
    token). Empty lists: no hit."""

    groups: list[list[KVCacheBlock | None]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    @property
    def blocks(self) -> list[KVCacheBlock | None]:
        """Group 0's entries (the only group of a model without sliding-window layers)."""
        return self.groups[0] if self.groups else []

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


@dataclass(slots=True)
class Allocation:
    """What the scheduler learns from a successful `allocate_slots`.

    block_ids is the request's whole block table of KV group 0, group_block_ids those of groups 1..
    (empty for a model without sliding-window layers); entries a window no longer reads are
    NULL_BLOCK_ID (read by no kernel). All read-only for the caller. copies lists (src_block_id,
    dst_block_id) pairs the model runner must copy before this step's forward: copy-on-write of a
    partly filled block shared with a sibling sequence.
    """

    block_ids: list[int]
    copies: list[tuple[int, int]]
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries_tokens: int = 0
    num_hits_tokens: int = 0  # from either tier
    num_tier_hits_tokens: int = 0  # of those, tokens whose blocks were loaded from the second tier


@dataclass(slots=True)
class TierPlan:
    """What the second tier adds to a waiting request's pool hit: the hit grows to `num_blocks`
    blocks; `held` are the pool blocks it needs (kept from eviction while it loads), `loads` the
    (group, block_idx, key) of those that come from the tier."""

    num_blocks: int
    held: list[KVCacheBlock]
    loads: list[tuple[int, int, TierKey]]


# The block id a table shows where a sliding-window group holds no block (wholly before the
# window): kernels never read it (tests/kernels fill such blocks with NaN to prove it).
NULL_BLOCK_ID = 0
RECENT_WINDOW_FREED = 256  # window-freed block ids kept for the dashboard

@dataclass(slots=True)
class _Table:
    """One group's block table of one request: the blocks, their ids (kept alongside, so a step
    reads them without rebuilding a list), and how many leading entries the window gave back."""

    blocks: list[KVCacheBlock | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_dropped: int = 0

    def extend(self, blocks: list[KVCacheBlock | None]) -> None:
        self.blocks.extend(blocks)
        self.ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in blocks)

    def set(self, idx: int, block: KVCacheBlock | None) -> None:
        self.blocks[idx] = block
        self.ids[idx] = NULL_BLOCK_ID if block is None else block.block_id

    def held(self) -> list[KVCacheBlock]:
        return [b for b in self.blocks[self.num_dropped :] if b is not None]

    def copy(self) -> _Table:
        return _Table(list(self.blocks), list(self.ids), self.num_dropped)


class KVCacheManager:
    """Keeps each request's block tables (one per KV group) and hashes on top of a BlockPool.

    KV groups: layers grouped by attention kind, each group the same number of layers (see
    config.kv_groups), so one pool block holds block_size tokens of any one group. A global group
    keeps a block for every token; a sliding-window group of window W gives back, as the request
    advances, every block wholly before the window of its next token, so a long sequence holds
    about W / block_size + 1 blocks there. Table entries it gave back become None.

    Invariants: every block is either in the free queue (ref_cnt 0) or held; a block's ref_cnt
    equals the number of table entries that hold it.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = (None,), tier: TierIndex | None = None,
    ) -> None:
        """`tier`: the second KV tier's index (needs prefix caching): cached blocks the pool
        evicts are offered to it, and prefix lookups continue into it."""
        if tier is not None and not enable_prefix_caching:
            raise ValueError("a second KV tier holds prefix-cache blocks: it needs prefix caching on")
        if not group_windows:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[_Table]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Full blocks scheduled in this step but not yet computed: rid -> their hashes, and how
        # many requests are computing each hash. A waiting request whose next block is among
        # them waits one step and then hits it, rather than computing the same KV twice.
        self._in_flight: dict[str, list[bytes]] = {}
        self._num_in_flight: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()
        self.tier = tier
        if tier is not None:
            self.pool.evicted = []
        # whether a preempted request's blocks go to the tier when evicted (a swap) or are let go
        # (it recomputes them): the engine sets it from what it measures at start
        self.swap_preempted = tier is not None
        # Second tier: pool blocks held for a waiting request until it is admitted (what its
        # hit needs, loads included), and this step's loads (target block, key) per request.
        self._prefetched: dict[str, list[KVCacheBlock]] = {}
        self._loading: dict[str, list[tuple[KVCacheBlock, TierKey]]] = {}
        self._tier_loads: list[TierTransfer] = []
        self._loaded_ids: dict[str, set[int]] = {}  # group-0 blocks loaded for a waiting request
        # Running requests that load the next blocks of their table this step (`extend_from_tier`):
        # rid -> the table index of the first one, and (target block, key) per load; loads of a
        # request freed meanwhile are orphans, their blocks kept until the runner is done with them.
        self._run_loads: dict[str, tuple[int, int, list[tuple[KVCacheBlock, TierKey]]]] = {}
        self._orphan_loads: list[tuple[KVCacheBlock, TierKey]] = []
        # Pinned prefixes: blocks held by no request, never evicted (each with its hash-map key,
        # kept through a reset of the prefix cache); at most `max_pinned_blocks` of them.
        self._pinned: list[tuple[KVCacheBlock, object]] = []
        self.max_pinned_blocks = 0
        # Blocks sliding windows gave back (a count since start, and the last few ids, bounded):
        # what the dashboard draws as a local layer's blocks freed while its request runs on.
        self.num_window_freed = 0
        self.recent_window_freed: deque[int] = deque(maxlen=RECENT_WINDOW_FREED)

    # ---- reads -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def usage(self) -> float:
        return self.pool.usage()

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group (NULL_BLOCK_ID where a window holds none)."""
        return [table.ids for table in self._tables.get(request_id, [])]

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (the whole table of a model without sliding-window layers)."""
        tables = self._tables.get(request_id)
        return tables[0].ids if tables else []

    def table_entries(self, request_id: str) -> list[list[int | None]]:
        """The request's block ids per group, None where its window gave the block back (unlike
        `block_tables`, whose placeholder id is a real block's too). A fresh list: O(table)."""
        return [[None if b is None else b.block_id for b in table.blocks] for table in self._tables.get(request_id, [])]

    def held_blocks(self, request_id: str) -> list[int]:
        """Every block the request holds, over all groups (NULL entries left out)."""
        return [b.block_id for table in self._tables.get(request_id, []) for b in table.held()]

    def live_request_ids(self) -> list[str]:
        """The requests that hold block tables now (running, or preempted mid-step until freed)."""
        return list(self._tables)

    def block_position(self, request_id: str, block_id: int) -> int | None:
        """Where the request's tables hold block `block_id` (its index in its group's table), or None."""
        for table in self._tables.get(request_id, []):
            for idx, block in enumerate(table.blocks):
                if block is not None and block.block_id == block_id:
                    return idx
        return None

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_to_admit(self, request: Request, num_new_tokens: int, computed: ComputedBlocks) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens, computed)` takes for a waiting
        request (no table yet): its new blocks, and the hit's blocks that sit in the free queue."""
        end = computed.num_tokens(self.block_size) + num_new_tokens
        hits = computed.groups or [[] for _ in self.group_windows]
        return sum(max(0, self.num_blocks_for(end) - len(hit)) + sum(1 for b in hit if b is not None and b.ref_cnt == 0)
                   for hit in hits)

    def num_blocks_to_hold(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most (config.blocks_to_hold)."""
        return blocks_to_hold(self.group_windows, num_tokens, self.block_size, max_chunk)

    def _first_needed_block(self, group: int, start: int) -> int:
        """The first table index group `group` must hold for queries starting at position
        `start` (0 for a global group): keys before start - window + 1 are never read again."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, start - window + 1) // self.block_size

    def _key(self, group: int, block_hash: bytes):
        """The hash-map key of a block of `group` (group 0: the bare chained hash)."""
        return block_hash if group == 0 else (group, block_hash)

    @staticmethod
    def _tier_key(pool_key) -> TierKey:
        """The second tier's key of a hash-map key (the inverse of `_key`)."""
        return pool_key if isinstance(pool_key, tuple) else (0, pool_key)

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                hashes, request.all_token_ids, self.block_size, request.cache_salt, request.lora_cache_key,
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request that every group can serve; changes nothing.

        A global group needs every block up to the hit point; a sliding-window group only those
        inside the window of the first token after it. The hit never covers the last token: its
        logits must be computed, so a request whose whole prompt is cached still recomputes its
        last block.
        """
        hashes = self._lookup_hashes(request)
        num_hit = self._num_hit(hashes, self._in_pool)
        if num_hit == 0:
            return ComputedBlocks()
        groups = []
        for g in range(self.num_groups):
            first = self._first_needed_block(g, num_hit * self.block_size)
            groups.append([None] * first + [self.pool.lookup(self._key(g, h)) for h in hashes[first:num_hit]])
        return ComputedBlocks(groups)

    def num_reusable_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix its admission would take from the cache now: the pool,
        and the second tier where there is one. Changes nothing but the request's hashes (made
        once)."""
        return self.reusable_tokens_counter()(request)

    def reusable_tokens_counter(self) -> Callable[[Request], int]:
        """`num_reusable_tokens` for many requests at one moment (the cache must not change while
        it is used): a walk of each request's block hashes up to its first miss, except that a
        request whose chain matches one counted before through that one's last hit starts there
        (requests of one system prompt cost one walk between them, then a comparison each)."""
        bs, num_lookup, block_hashes = self.block_size, self._num_lookup_blocks, self._block_hashes
        if self.group_windows != (None,):
            available = self._in_pool if self.tier is None else self._in_either_tier
            return lambda r: self._num_hit(self._lookup_hashes(r), available) * bs
        cached, tier = self.pool.cached, self.tier
        last: dict[bytes, tuple[list[bytes], int, int]] = {}  # first hash -> (hashes, hit, lookup size) counted last

        def count(request: Request) -> int:
            num = num_lookup(request)
            if num == 0:
                return 0
            hashes = block_hashes(request)
            num_hit = 0
            seen = last.get(hashes[0])
            if seen is not None:
                other, other_hit, other_num = seen
                if other_hit == 0 or (other_hit <= num and hashes[other_hit - 1] == other[other_hit - 1]):
                    num_hit = min(other_hit, num)  # the same chain through the other's hits
                    if other_hit < other_num and other_hit < num and hashes[other_hit] == other[other_hit]:
                        return num_hit * bs  # and the same first miss
            while num_hit < num and (hashes[num_hit] in cached or (tier is not None and tier.lookup((0, hashes[num_hit])) is not None)):
                num_hit += 1
            last[hashes[0]] = (hashes, num_hit, num)
            return num_hit * bs
        return count

    def preemption_cost(self, request: Request) -> tuple[int, int]:
        """What preempting a running request would cost and give back: (tokens it would compute
        again, or with a second tier that takes preempted blocks the blocks it would write there;
        blocks freed). Only blocks it alone holds count: shared ones stay held; a full block the
        tier already has costs nothing; a partial block is always recomputed. Changes nothing."""
        bs = self.block_size
        swaps = self.tier is not None and self.swap_preempted
        cost = num_freed = 0
        for g, table in enumerate(self._tables.get(request.request_id, [])):
            for idx in range(table.num_dropped, len(table.blocks)):
                block = table.blocks[idx]
                if block is None or block.ref_cnt != 1:
                    continue
                num_freed += 1
                num_tokens = min(bs, max(0, request.num_computed_tokens - idx * bs))
                if block.block_hash is None or not swaps:
                    cost += num_tokens
                elif self.tier.lookup(self._tier_key(self._key(g, block.block_hash))) is None:
                    cost += 1  # one block to write (and read back): far cheaper than recomputing it
        return cost, num_freed

    def _lookup_hashes(self, request: Request) -> list[bytes]:
        """The hashes a prefix lookup may hit: every full block before the last token (none when
        caching is off, or for prompt logprobs, which need every prompt position computed, as
        vLLM v1 does)."""
        num = self._num_lookup_blocks(request)
        return self._block_hashes(request)[:num] if num else []

    def _num_lookup_blocks(self, request: Request) -> int:
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def _in_pool(self, group: int, block_hash: bytes) -> bool:
        return self.pool.lookup(self._key(group, block_hash)) is not None

    def _in_either_tier(self, group: int, block_hash: bytes) -> bool:
        return self._in_pool(group, block_hash) or self.tier.lookup((group, block_hash)) is not None

    def _num_hit(self, hashes: list[bytes], available) -> int:
        """The longest prefix (in blocks) every group can serve: a global group needs every block
        up to it, a sliding-window group those inside the window of the first token after it;
        `available(group, hash)` says whether one block can be had."""
        num_hit = len(hashes)
        for g, window in enumerate(self.group_windows):
            if window is None:  # the longest chain of hits
                num_hit = next((i for i, h in enumerate(hashes[:num_hit]) if not available(g, h)), num_hit)
        while num_hit > 0 and not all(
            self._window_hit(g, hashes, num_hit, available) for g, w in enumerate(self.group_windows) if w is not None
        ):
            num_hit -= 1
        return num_hit

    def _window_hit(self, group: int, hashes: list[bytes], num_hit: int, available) -> bool:
        first = self._first_needed_block(group, num_hit * self.block_size)
        return all(available(group, h) for h in hashes[first:num_hit])

    # ---- writes ------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Grow the request's tables so tokens [start, start + num_new_tokens) have slots in
        every group.

        start is request.num_computed_tokens, or the hit's length when `computed` is given (a
        request being admitted, whose tables must be empty). First, sliding-window groups give
        back the blocks wholly before the window of token `start` (never read again; a cached
        one stays findable until evicted). Then returns None, changing nothing more, when the
        pool cannot supply the blocks. Nothing is entered into the prefix cache here: a block
        becomes shareable only once its tokens are computed (`cache_blocks`, after the step), so
        a request preempted after being scheduled cannot leave hashes on blocks whose KV was
        never written.

            table:  | gone | full | part |  new  |  new  |
                                  ^start        ^start + num_new_tokens
            a shared `part` block is copied first (copy-on-write); full blocks are never copied;
            `gone`: None entries of a sliding-window group, before the window of `start`.
        """
        rid = request.request_id
        tables = self._tables.setdefault(rid, [_Table() for _ in self.group_windows])
        if computed is not None and computed.num_blocks and any(t.blocks for t in tables):
            raise ValueError(f"request {rid} already holds blocks; a prefix hit applies only on admission")
        hit_groups = computed.groups if computed is not None and computed.groups else [[] for _ in tables]
        start = computed.num_tokens(self.block_size) if computed is not None else request.num_computed_tokens
        end = start + num_new_tokens
        for g, table in enumerate(tables):
            self._drop_outside_window(g, table, start)

        num_needed = 0
        copy_at: list[int | None] = []
        for table, hit in zip(tables, hit_groups):
            num_needed += max(0, self.num_blocks_for(end) - len(table.blocks) - len(hit))
            write_idx = start // self.block_size
            shared = start % self.block_size != 0 and write_idx < len(table.blocks) \
                and table.blocks[write_idx] is not None and table.blocks[write_idx].ref_cnt > 1
            copy_at.append(write_idx if shared else None)
            num_needed += int(shared)
            num_needed += sum(1 for block in hit if block is not None and block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks:
            return None

        if computed is not None:
            self.stats.num_queries_tokens += request.num_tokens
            self.stats.num_hits_tokens += computed.num_tokens(self.block_size)
            self._num_cached_blocks[rid] = max(self._num_cached_blocks.get(rid, 0), computed.num_blocks)
        for table, hit in zip(tables, hit_groups):  # every group's hits leave the free queue before
            self.pool.touch([block for block in hit if block is not None])  # any allocation can evict them
            table.extend(hit)
        copies: list[tuple[int, int]] = []
        for table, idx in zip(tables, copy_at):
            if idx is not None:
                shared_block = table.blocks[idx]
                (private,) = self.pool.allocate(1)
                copies.append((shared_block.block_id, private.block_id))
                self.pool.free([shared_block])
                table.set(idx, private)
            num_new_blocks = max(0, self.num_blocks_for(end) - len(table.blocks))
            if num_new_blocks:
                table.extend(self.pool.allocate(num_new_blocks))
        self._mark_in_flight(request, end)
        if computed is not None:
            loaded = self._loaded_ids.pop(rid, set())
            self.stats.num_tier_hits_tokens += self.block_size * sum(
                1 for b in computed.blocks if b is not None and b.block_id in loaded)
            self._release_prefetched(rid)  # the hit's own references now keep those blocks
        return Allocation(tables[0].ids, copies, [t.ids for t in tables[1:]])

    def _drop_outside_window(self, group: int, table: _Table, start: int) -> None:
        """Give back the group's blocks wholly before the window of token `start` (tail first)."""
        first = min(self._first_needed_block(group, start), len(table.blocks))
        if first <= table.num_dropped:
            return
        gone = [table.blocks[i] for i in range(first - 1, table.num_dropped - 1, -1) if table.blocks[i] is not None]
        for i in range(table.num_dropped, first):
            table.set(i, None)
        table.num_dropped = first
        self.pool.free(gone)
        self.num_window_freed += len(gone)
        self.recent_window_freed.extend(b.block_id for b in gone if b.ref_cnt == 0)

    def _mark_in_flight(self, request: Request, end: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        first = max(self._num_cached_blocks.get(rid, 0), len(self._in_flight.get(rid, ())))
        num_full = end // self.block_size
        if num_full <= first:
            return
        hashes = self._block_hashes(request)[first:num_full]
        self._in_flight.setdefault(rid, []).extend(hashes)
        for h in hashes:
            self._num_in_flight[h] = self._num_in_flight.get(h, 0) + 1

    def _clear_in_flight(self, rid: str) -> None:
        for h in self._in_flight.pop(rid, ()):
            left = self._num_in_flight[h] - 1
            if left:
                self._num_in_flight[h] = left
            else:
                del self._num_in_flight[h]

    def is_prefix_in_flight(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether the block right after the hit is being computed by another request this step
        (so waiting one step turns it into a hit)."""
        if not self._num_in_flight:
            return False
        hashes = self._block_hashes(request)
        idx = computed.num_blocks
        return idx < min(len(hashes), (request.num_tokens - 1) // self.block_size) and hashes[idx] in self._num_in_flight

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within its first `num_computed_tokens` tokens
        into the prefix cache, in every group that still holds them. Call only once the forward
        has written those tokens' KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        self._clear_in_flight(rid)
        tables = self._tables.get(rid)
        if tables is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(tables[0].blocks))
        first = self._num_cached_blocks.get(rid, 0)
        if num_full <= first:
            return
        hashes = self._block_hashes(request)
        for g, table in enumerate(tables):
            for block_idx in range(first, num_full):
                if table.blocks[block_idx] is not None:
                    self.pool.cache_block(table.blocks[block_idx], self._key(g, hashes[block_idx]))
        self._num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks wholly past its first `num_tokens` tokens (in every
        group, tail first): speculative slots whose drafts were rejected. Their KV is never
        entered into the prefix cache (`cache_blocks` stops at the accepted tokens) and the next
        step allocates afresh. Returns the number of table entries dropped."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return 0
        keep = self.num_blocks_for(num_tokens)
        num_dropped = 0
        for table in tables:
            if len(table.blocks) <= keep:
                continue
            gone = [b for b in table.blocks[keep:] if b is not None]
            self.pool.free(gone[::-1])
            num_dropped += len(table.blocks) - keep
            del table.blocks[keep:], table.ids[keep:]
        return num_dropped

    def fork(self, parent: Request, child: Request) -> list[int]:
        """Give `child` the parent's whole tables by reference (ref counts +1); returns its group-0
        block ids."""
        tables = [table.copy() for table in self._tables[parent.request_id]]
        for table in tables:
            self.pool.touch(table.held())
        self._tables[child.request_id] = tables
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)
        return tables[0].ids

    def free(self, request: Request, preempted: bool = False) -> None:
        """Return all the request's blocks (tail of each table first, so chains evict tail-first).

        The block hashes are kept: a preempted request recomputes the same tokens and can hit
        its own cached prefix. `remove` forgets them once the request has ended. A `preempted`
        request's blocks go to the second tier when evicted only if `swap_preempted`.
        """
        rid = request.request_id
        self._clear_in_flight(rid)
        self._release_prefetched(rid)
        tables = self._tables.pop(rid, [])
        if rid in self._run_loads:  # the runner writes its load targets this step: keep them till then
            first, _, loads = self._run_loads.pop(rid)
            targets = {id(block) for block, _ in loads}
            table = tables[0]
            kept = [b for b in table.blocks[first:] if id(b) not in targets]
            self.pool.free(kept[::-1])
            del table.blocks[first:], table.ids[first:]
            self._orphan_loads.extend(loads)
        self._num_cached_blocks.pop(rid, None)
        for table in tables:
            held = table.held()
            self.pool.free(held[::-1])
            if preempted and self.tier is not None and not self.swap_preempted:
                self.pool.skip_offload.update(b.block_id for b in held if b.ref_cnt == 0)

    def remove(self, request: Request) -> None:
        """Free the request's blocks and forget everything kept about it."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block of the pool and of the second tier, but the pinned prefixes'.
        Returns how many."""
        num_forgotten = self.pool.reset_prefix_cache() + (self.tier.clear() if self.tier is not None else 0)
        for block, key in self._pinned:
            self.pool.cache_block(block, key)
        return num_forgotten - len(self._pinned)

    # ---- pinned prefixes ---------------------------------------------------------------------

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def pinned_block_ids(self) -> list[int]:
        return [block.block_id for block, _ in self._pinned]

    def num_pinned_hits(self, request: Request) -> int:
        """Blocks of a request's table that would be pinned blocks (its prompt starts with a
        pinned prefix): they take nothing from the rest of the pool. Changes nothing."""
        if not self._pinned:
            return 0
        keys = {key for _, key in self._pinned}
        hashes = self._block_hashes(request)[: request.num_prompt_tokens // self.block_size]
        num = next((i for i, h in enumerate(hashes) if h not in keys), len(hashes))
        return num * sum(w is None for w in self.group_windows)

    def num_blocks_to_pin(self, request: Request) -> int:
        """Blocks `pin` would add for a request that computes its whole prompt: its prompt's full
        blocks (per KV group) not pinned already."""
        pinned = {key for _, key in self._pinned}
        hashes = self._block_hashes(request)[: request.num_prompt_tokens // self.block_size]
        return sum(self._key(g, h) not in pinned for g in range(self.num_groups) for h in hashes)

    def pin(self, request: Request) -> int:
        """Keep the full blocks of the request's prompt (it is ending) in the pool for good: held by
        no request, never evicted, found by every later prefix lookup; at most up to
        `max_pinned_blocks` in all (check `num_blocks_to_pin` first). Blocks already pinned are not
        counted twice. Returns how many blocks were pinned."""
        pinned = {key for _, key in self._pinned}
        new = []
        num_prompt_blocks = request.num_prompt_tokens // self.block_size  # its output is not part of the prefix
        for table in self._tables.get(request.request_id, []):
            for block in table.blocks[table.num_dropped : num_prompt_blocks]:
                key = None if block is None else block.block_hash
                if key is not None and key not in pinned and self.pool.lookup(key) is block:
                    new.append((block, key))
                    pinned.add(key)
        new = new[: max(0, self.max_pinned_blocks - len(self._pinned))]
        self.pool.touch([block for block, _ in new])
        self._pinned.extend(new)
        return len(new)

    def unpin_all(self) -> int:
        """Let every pinned block go (they stay cached, evictable as any other). Returns how many."""
        blocks = [block for block, _ in self._pinned]
        self._pinned = []
        self.pool.free(blocks[::-1])
        return len(blocks)

    # ---- the second tier ---------------------------------------------------------------------

    def plan_tier_load(self, request: Request, computed: ComputedBlocks) -> TierPlan | None:
        """What the tier adds to `computed` (the request's pool hit), or None when it adds
        nothing. Changes nothing."""
        if self.tier is None or not len(self.tier):
            return None
        hashes = self._lookup_hashes(request)
        num_hit = self._num_hit(hashes, self._in_either_tier)
        if num_hit <= computed.num_blocks:
            return None
        held: list[KVCacheBlock] = []
        loads: list[tuple[int, int, TierKey]] = []
        for g in range(self.num_groups):
            for idx in range(self._first_needed_block(g, num_hit * self.block_size), num_hit):
                block = self.pool.lookup(self._key(g, hashes[idx]))
                if block is not None:
                    held.append(block)
                else:
                    loads.append((g, idx, (g, hashes[idx])))
        return TierPlan(num_hit, held, loads)

    def start_tier_load(self, request: Request, plan: TierPlan, num_extra_blocks: int = 0) -> bool:
        """Hold the plan's pool blocks and take free blocks for its loads, which this step's
        SchedulerOutput carries (`take_tier_work`). False, changing nothing, when the pool cannot
        spare them and `num_extra_blocks` more (what its first chunk will need: loading what
        cannot be admitted next step would only churn). The request waits for
        `finish_tier_loads` before its admission."""
        rid = request.request_id
        if rid in self._loading:
            raise ValueError(f"request {rid} is already loading from the KV tier")
        held = list(dict.fromkeys(plan.held))
        num_free_after_hold = self.pool.num_free_blocks - sum(1 for b in held if b.ref_cnt == 0)
        if num_free_after_hold < len(plan.loads) + num_extra_blocks:
            return False
        self.pool.touch(held)
        # back from an earlier round (blocks written to the tier since then were found): the new
        # holds cover the old ones, taken before those are let go; what it loaded then still counts
        loaded = self._loaded_ids.get(rid)
        self._release_prefetched(rid)
        self._prefetched[rid] = held
        if loaded:
            self._loaded_ids[rid] = loaded
        targets = self.pool.allocate(len(plan.loads))
        self._loading[rid] = []
        for block, (_, _, key) in zip(targets, plan.loads):
            self._tier_loads.append(TierTransfer(block.block_id, self.tier.pin(key), key))
            self._loading[rid].append((block, key))
        return True

    def is_tier_load_in_flight(self, plan: TierPlan) -> bool:
        """Whether another request loads one of the plan's blocks this step (waiting one step
        then finds it in the pool, rather than reading it twice)."""
        loading = self._keys_loading()
        return any(key in loading for _, _, key in plan.loads)

    def _keys_loading(self) -> set[TierKey]:
        keys = {key for loads in self._loading.values() for _, key in loads}
        return keys | {key for _, _, loads in self._run_loads.values() for _, key in loads}

    def extend_from_tier(self, request: Request, max_blocks: int) -> tuple[int, int] | None:
        """A running request whose next full blocks are cached takes them rather than computing
        them. Returns (table entries taken, how many of them load from the second tier):
        - (n, 0): its next n blocks were in the pool, shared at once;
        - (n, k): k of them come from the second tier, read before this step's forward into free
          blocks appended to its table, the others shared from the pool; `finish_run_loads` says
          whether all arrived (if not, the runner skips the request's chunk of the step and the
          caller rolls it back);
        - (0, 0): its next block is in neither, or it is not at a block boundary;
        - None: the pool cannot take its next cached block (the caller frees some, as for a chunk).
        Either way the caller counts the entries computed, and may compute on after them in the
        same step unless `next_block_cached` (then taking more next step beats recomputing).
        At most `max_blocks`, never its last token's block, never a block another request loads
        this step. One global KV group only (with sliding windows, loads happen at admission)."""
        tables = self._tables.get(request.request_id)
        if self.tier is None or self.group_windows != (None,) or not len(self.tier) or tables is None \
                or request.num_computed_tokens % self.block_size:
            return 0, 0
        table = tables[0]
        start = request.num_computed_tokens // self.block_size
        if len(table.blocks) != start:
            return 0, 0
        end = min(self._num_lookup_blocks(request), start + max_blocks)
        if end <= start:  # decoding, or nothing left before the last token: compute on
            return 0, 0
        hashes = self._block_hashes(request)[start:end]
        loading = self._keys_loading()
        available = self.pool.num_free_blocks
        plan: list[KVCacheBlock | TierKey] = []  # a pool block to share, or the key of a load
        for h in hashes:
            block = self.pool.lookup(h)
            if block is not None:
                cost, entry = int(block.ref_cnt == 0), block
            elif (0, h) in loading or self.tier.lookup((0, h)) is None:
                break
            else:
                cost, entry = 1, (0, h)
            if cost > available:
                break
            available -= cost
            plan.append(entry)
        if not plan:
            in_tier = bool(hashes) and (0, hashes[0]) not in loading and self.tier.lookup((0, hashes[0])) is not None
            return None if in_tier else (0, 0)
        self._take_from_tier(request, table, start, plan)
        num_loading = sum(1 for e in plan if not isinstance(e, KVCacheBlock))
        if not num_loading:  # all shared from the pool: computed now (loads count when they end)
            self._note_extended(request.request_id, start + len(plan), len(plan), 0)
        return len(plan), num_loading

    def next_block_cached(self, request: Request) -> bool:
        """Whether the block at the request's computed tokens (on a block boundary) is one it may
        take from the cache (pool or second tier) rather than compute."""
        if self.tier is None or request.num_computed_tokens % self.block_size:
            return False
        idx = request.num_computed_tokens // self.block_size
        if idx >= self._num_lookup_blocks(request):
            return False
        h = self._block_hashes(request)[idx]
        return self._in_either_tier(0, h)

    def _take_from_tier(self, request: Request, table: _Table, start: int, plan: list) -> None:
        shared = [e for e in plan if isinstance(e, KVCacheBlock)]
        self.pool.touch(shared)  # out of the free queue before any allocation can evict them
        targets = iter(self.pool.allocate(len(plan) - len(shared)))
        loads = []
        for entry in plan:
            block = entry if isinstance(entry, KVCacheBlock) else next(targets)
            table.extend([block])
            if block is not entry:
                loads.append((block, entry))
                self._tier_loads.append(TierTransfer(block.block_id, self.tier.pin(entry), entry))
        if loads:
            self._run_loads[request.request_id] = (start, len(plan), loads)

    def _note_extended(self, rid: str, num_cached: int, num_blocks: int, num_loaded: int) -> None:
        """Count blocks a running request took from the cache as hits (they are cached already)."""
        self.stats.num_hits_tokens += num_blocks * self.block_size
        self.stats.num_tier_hits_tokens += num_loaded * self.block_size
        self._num_cached_blocks[rid] = max(self._num_cached_blocks.get(rid, 0), num_cached)

    def finish_run_loads(self, loaded: dict[int, bool]) -> dict[str, tuple[int, int, int]]:
        """Apply the runner's report on running requests' loads (`extend_from_tier`): a good block
        enters the prefix cache; the request keeps the entries before its first bad one and frees
        the rest, with anything it allocated after them this step (a good block after it stays
        cached in the pool). Returns rid -> (first entry, entries kept, entries planned): a
        request that kept fewer than planned stands at (first + kept) blocks computed and its
        chunk of this step (skipped by the runner) is void. Loads whose request was freed
        meanwhile only fill the prefix cache."""
        out = {}
        for block, key in self._orphan_loads:  # their request was preempted or ended meanwhile
            ok = loaded.get(block.block_id, False)
            self.tier.unpin(key, ok)
            if ok:
                self.pool.cache_block(block, self._key(*key))
            self.pool.free([block])
        self._orphan_loads.clear()
        for rid, (start, num_entries, loads) in self._run_loads.items():
            bad_idx = num_entries
            targets = {id(block): i for i, (block, _) in enumerate(loads)}
            for block, key in loads:
                ok = loaded.get(block.block_id, False)
                self.tier.unpin(key, ok)
                if ok:
                    self.pool.cache_block(block, key[1])
            table = self._tables[rid][0]
            for idx in range(start, start + num_entries):
                i = targets.get(id(table.blocks[idx]))
                if i is not None and not loaded.get(loads[i][0].block_id, False):
                    bad_idx = idx - start
                    break
            if bad_idx < num_entries:
                dropped = table.blocks[start + bad_idx :]
                del table.blocks[start + bad_idx :], table.ids[start + bad_idx :]
                self.pool.free(dropped[::-1])
                self._clear_in_flight(rid)  # its chunk's blocks are never cached
            num_loaded = sum(1 for idx in range(start, start + bad_idx) if id(table.blocks[idx]) in targets)
            self._note_extended(rid, start + bad_idx, bad_idx, num_loaded)
            out[rid] = (start, bad_idx, num_entries)
        self._run_loads.clear()
        return out

    def take_tier_work(self) -> tuple[list[TierTransfer], list[TierTransfer]]:
        """(stores, loads) for this step's SchedulerOutput, and forget them here: every cached
        block the pool evicted since the last call that the tier takes (a slot reserved), and the
        loads started. Empty lists without a tier."""
        if self.tier is None:
            return [], []
        stores = []
        for block_id, pool_key in self.pool.evicted:
            key = self._tier_key(pool_key)
            slot = self.tier.reserve(key)
            if slot is not None:
                stores.append(TierTransfer(block_id, slot, key))
        self.pool.evicted.clear()
        loads, self._tier_loads = self._tier_loads, []
        return stores, loads

    def finish_tier_loads(self, loaded: dict[int, bool]) -> list[str]:
        """Apply the runner's report on this step's loads (pool block id -> checksum passed): a
        good block enters the pool's prefix cache, held for its request until admission; a bad one
        is dropped from the tier and freed. Returns the ids of requests whose loads ended."""
        ended = []
        for rid, loads in self._loading.items():
            for block, key in loads:
                ok = loaded.get(block.block_id, False)
                self.tier.unpin(key, ok)
                if ok:
                    self.pool.cache_block(block, self._key(*key))
                    self._prefetched.setdefault(rid, []).append(block)
                    if key[0] == 0:  # counted as a tier hit if its request is admitted with it
                        self._loaded_ids.setdefault(rid, set()).add(block.block_id)
                else:
                    self.pool.free([block])
            ended.append(rid)
        self._loading.clear()
        return ended

    def finish_tier_stores(self, stored: list[tuple[int, bool]]) -> None:
        """Apply the runner's report on finished writes: (slot, written)."""
        for slot, ok in stored:
            self.tier.commit(slot, ok)

    def tier_flush_plan(self) -> list[TierTransfer]:
        """Every block cached in the pool that the tier lacks, with a slot reserved for it: what
        a server writes at shutdown, so that a restart finds what it served last."""
        if self.tier is None:
            return []
        out = []
        for pool_key, block in self.pool.cached.items():
            key = self._tier_key(pool_key)
            slot = self.tier.reserve(key)
            if slot is not None:
                out.append(TierTransfer(block.block_id, slot, key))
        return out

    def blocks_held_for_loads(self) -> list[int]:
        """Block ids held for waiting requests' tier loads (one entry per reference)."""
        held = [b.block_id for blocks in self._prefetched.values() for b in blocks]
        held += [b.block_id for b, _ in self._orphan_loads]
        return held + [b.block_id for loads in self._loading.values() for b, _ in loads]

    def num_blocks_held_for(self, request: Request) -> int:
        """Blocks held for a waiting request back from the tier (its hit will take them over)."""
        return len(self._prefetched.get(request.request_id, ()))

    def release_prefetched(self, request: Request) -> None:
        """Let go of the blocks held for a waiting request back from the tier (they stay cached,
        so a later lookup still finds them, or the tier once the pool evicts them)."""
        self._release_prefetched(request.request_id)

    def _release_prefetched(self, rid: str) -> None:
        if rid in self._loading:
            raise ValueError(f"request {rid} has tier loads in flight: its blocks are freed once they end")
        held = self._prefetched.pop(rid, None)
        self._loaded_ids.pop(rid, None)
        if held:
            self.pool.free(held[::-1])

    def check_invariants(self) -> list[str]:
        """Problems found in the pool and tables (empty when sound); O(num_blocks), for tests and
        the server's debug endpoint. Checks that every block is free (in the queue once, ref 0)
        or held with ref_cnt equal to the number of tables holding it, and that the hash map
        points only at blocks carrying that hash."""
        problems: list[str] = []
        free_ids = self.pool.free_queue.block_ids()
        if len(free_ids) != len(set(free_ids)):
            problems.append("a block is in the free queue twice")
        if len(free_ids) != self.pool.num_free_blocks:
            problems.append(f"free queue holds {len(free_ids)} blocks but counts {self.pool.num_free_blocks}")
        holders: dict[int, int] = {}
        held_lists = [table.held() for tables in self._tables.values() for table in tables]
        held_lists += list(self._prefetched.values())
        held_lists += [[block for block, _ in loads] for loads in self._loading.values()]
        held_lists.append([block for block, _ in self._orphan_loads])
        held_lists.append([block for block, _ in self._pinned])
        for blocks in held_lists:
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free_set = set(free_ids)
        for block in self.pool.blocks:
            held = holders.get(block.block_id, 0)
            if block.ref_cnt != held:
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {held} tables")
            if (block.ref_cnt == 0) != (block.block_id in free_set):
                problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block.block_id in free_set}")
        for block_hash, block in self.pool.cached.items():
            if block.block_hash != block_hash:
                problems.append(f"hash map entry points at {block} with another hash")
        if self.tier is not None:
            problems += self.tier.check_invariants()
        return problems

