"""One manager per attention kind: a KV group's block tables and the rules of its kind.

KVCacheManager coordinates one of these per KV group (config.kv_groups) over one shared BlockPool.
Each owns its requests' block tables in its group and answers by the rules of its attention kind:
which table entries a query from a position still reads, how long a cached prefix it can serve,
how many blocks a range of tokens needs, and which blocks a window has passed. A new kind (chunked
local attention, a recurrent state) is a subclass giving those answers, entered in `GROUP_KINDS`.

Every group is alike to its callers: a table is one list per group, keys are (group, hash).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from octavo.config import blocks_to_hold
from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock

BlockKey = tuple[int, bytes]  # (KV group, chained block hash): the pool's hash-map key, and the tier's

# The block id a table shows where a group holds no block (a window passed it): kernels never
# read it (tests/kernels fill such blocks with NaN to prove it).
NULL_BLOCK_ID = 0


@dataclass(slots=True)
class BlockTable:
    """One group's block table of one request: the blocks, their ids (kept alongside, so a step
    reads them without rebuilding a list), and how many leading entries were given back."""

    blocks: list[KVCacheBlock | None] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_dropped: int = 0

    def extend(self, blocks: list[KVCacheBlock | None]) -> None:
        self.blocks.extend(blocks)
        self.ids.extend(NULL_BLOCK_ID if b is None else b.block_id for b in blocks)

    def set(self, idx: int, block: KVCacheBlock | None) -> None:
        self.blocks[idx] = block
        self.ids[idx] = NULL_BLOCK_ID if block is None else block.block_id

    def truncate(self, keep: int) -> list[KVCacheBlock]:
        """Cut the table to its first `keep` entries; returns the blocks cut (None entries left out)."""
        gone = [b for b in self.blocks[keep:] if b is not None]
        del self.blocks[keep:], self.ids[keep:]
        self.num_dropped = min(self.num_dropped, keep)
        return gone

    def held(self) -> list[KVCacheBlock]:
        return [b for b in self.blocks[self.num_dropped :] if b is not None]

    def copy(self) -> BlockTable:
        return BlockTable(list(self.blocks), list(self.ids), self.num_dropped)


class GroupManager:
    """The block tables of one KV group. Subclasses give the rules of an attention kind; the
    bookkeeping (hits, growth, copy-on-write, caching, trimming, forks) is the same for all.

    Mutates only its tables and, through the pool, ref counts; never decides whether the pool
    has room (the coordinator adds up every group's need first)."""

    kind: ClassVar[str] = ""
    holds_every_block: ClassVar[bool] = True  # whether a table keeps a block for every token

    def __init__(self, group_id: int, pool: BlockPool, block_size: int, window: int | None = None) -> None:
        self.group_id = group_id
        self.pool = pool
        self.block_size = block_size
        self.window = window
        self.tables: dict[str, BlockTable] = {}

    # ---- the rules of the kind ---------------------------------------------------------------

    def first_needed_block(self, start: int) -> int:
        """The first table index a query at position `start` or later still reads."""
        raise NotImplementedError

    def num_blocks_to_hold(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """Blocks one sequence of `num_tokens` tokens holds here at most, computed in chunks of at
        most `max_chunk` tokens."""
        raise NotImplementedError

    def hit_length(self, hashes: list[bytes], start: int, end: int, available: Callable[[BlockKey], bool]) -> int:
        """The furthest n in [start, end] such that this group can take table entries [start, n)
        from the cache: of those, every one a query at block n reads must be `available` (the
        entries before `start` are held already). From start 0: the longest prefix hit."""
        raise NotImplementedError

    # ---- reads -------------------------------------------------------------------------------

    def key(self, block_hash: bytes) -> BlockKey:
        return (self.group_id, block_hash)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hit_blocks(self, hashes: list[bytes], start: int, end: int) -> list[KVCacheBlock | None]:
        """Table entries [start, end) as the pool holds them: None for those a query at block
        `end` never reads, and for those the pool lacks (see `is_read_after`)."""
        first = max(start, self.first_needed_block(end * self.block_size))
        return [None] * (first - start) + [self.pool.lookup(self.key(h)) for h in hashes[first:end]]

    def is_read_after(self, idx: int, end: int) -> bool:
        """Whether table entry `idx` is read by a query at block `end` or later."""
        return idx >= self.first_needed_block(end * self.block_size)

    def ahead(self, hashes: list[bytes], start: int, end: int) -> tuple[list[KVCacheBlock | None], int]:
        """Entries [start, end) of a run taken from the cache (`hit_blocks`), and the free blocks
        taking them costs: one per entry to load, and the pool's that sit in the free queue."""
        entries = self.hit_blocks(hashes, start, end)
        cost = sum(1 for i, b in enumerate(entries)
                   if (b is None and self.is_read_after(start + i, end)) or (b is not None and b.ref_cnt == 0))
        return entries, cost

    def num_blocks_needed(self, rid: str, start: int, end: int, hit: list[KVCacheBlock | None]) -> int:
        """Free blocks `grow(rid, start, end)` after `take_hit(rid, hit)` takes: new blocks up to
        token `end`, a private copy of a shared partial block written at `start`, and the hit's
        blocks that sit in the free queue."""
        table = self.tables.get(rid)
        num_held = len(table.blocks) if table is not None else 0
        need = max(0, self.num_blocks_for(end) - num_held - len(hit))
        need += sum(1 for block in hit if block is not None and block.ref_cnt == 0)
        return need + int(self._shared_write_idx(table, start) is not None)

    def _shared_write_idx(self, table: BlockTable | None, start: int) -> int | None:
        """The entry of a partly filled block shared with a sibling that a write at `start` lands in."""
        idx = start // self.block_size
        if table is None or start % self.block_size == 0 or idx >= len(table.blocks):
            return None
        block = table.blocks[idx]
        return idx if block is not None and block.ref_cnt > 1 else None

    # ---- writes ------------------------------------------------------------------------------

    def drop_passed(self, rid: str, start: int) -> list[KVCacheBlock]:
        """Give back the blocks wholly before what a query at `start` reads (tail first); returns
        them. Their entries become None; a cached one stays findable until evicted."""
        table = self.tables.get(rid)
        if table is None:
            return []
        first = min(self.first_needed_block(start), len(table.blocks))
        if first <= table.num_dropped:
            return []
        gone = [table.blocks[i] for i in range(first - 1, table.num_dropped - 1, -1) if table.blocks[i] is not None]
        for i in range(table.num_dropped, first):
            table.set(i, None)
        table.num_dropped = first
        self.pool.free(gone)
        return gone

    def take_hit(self, rid: str, hit: list[KVCacheBlock | None]) -> None:
        """Start the request's table with a prefix hit's entries (held from now on)."""
        self.pool.touch([block for block in hit if block is not None])
        self.tables.setdefault(rid, BlockTable()).extend(hit)

    def grow(self, rid: str, start: int, end: int) -> tuple[int, int] | None:
        """Give tokens [start, end) slots: copy a shared partial block written at `start`
        (returned as (src, dst) block ids for the runner), then append new blocks up to `end`.
        The pool must have room (`num_blocks_needed`)."""
        table = self.tables.setdefault(rid, BlockTable())
        copy = None
        idx = self._shared_write_idx(table, start)
        if idx is not None:
            shared = table.blocks[idx]
            (private,) = self.pool.allocate(1)
            copy = (shared.block_id, private.block_id)
            self.pool.free([shared])
            table.set(idx, private)
        num_new = max(0, self.num_blocks_for(end) - len(table.blocks))
        if num_new:
            table.extend(self.pool.allocate(num_new))
        return copy

    def load_targets(self, rid: str, hashes: list[bytes], start: int, end: int) -> list[tuple[int, KVCacheBlock, BlockKey]]:
        """After `take_hit(rid, entries)` of a run [start, end): a free block for each entry still
        empty that a query at `end` reads (its content comes from the tier), as (table index,
        block, key). The pool must have room (`ahead`'s cost)."""
        table = self.tables[rid]
        loads = []
        for idx in range(start, end):
            if table.blocks[idx] is None and self.is_read_after(idx, end):
                (target,) = self.pool.allocate(1)
                table.set(idx, target)
                loads.append((idx, target, self.key(hashes[idx])))
        return loads

    def cache(self, rid: str, hashes: list[bytes], first: int, num_full: int) -> None:
        """Enter the request's table entries [first, num_full) that still hold a block into the
        prefix cache, under `hashes`."""
        table = self.tables[rid]
        for idx in range(first, min(num_full, len(table.blocks))):
            block = table.blocks[idx]
            if block is not None:
                self.pool.cache_block(block, self.key(hashes[idx]))

    def trim(self, rid: str, keep: int) -> int:
        """Give back the entries past the first `keep` (tail first); returns how many there were."""
        table = self.tables.get(rid)
        if table is None or len(table.blocks) <= keep:
            return 0
        num = len(table.blocks) - keep
        self.pool.free(table.truncate(keep)[::-1])
        return num

    def fork(self, parent: str, child: str) -> None:
        """The child holds the parent's whole table by reference (ref counts +1)."""
        table = self.tables[parent].copy()
        self.pool.touch(table.held())
        self.tables[child] = table

    def free(self, rid: str) -> list[KVCacheBlock]:
        """Forget the request's table and let go of its blocks (tail first); returns them."""
        table = self.tables.pop(rid, None)
        if table is None:
            return []
        held = table.held()
        self.pool.free(held[::-1])
        return held


class FullAttention(GroupManager):
    """Global attention: every token's KV is read by every later query."""

    kind = "full"

    def first_needed_block(self, start: int) -> int:
        return 0

    def num_blocks_to_hold(self, num_tokens: int, max_chunk: int | None = None) -> int:
        return blocks_to_hold((None,), num_tokens, self.block_size, max_chunk)

    def hit_length(self, hashes: list[bytes], start: int, end: int, available: Callable[[BlockKey], bool]) -> int:
        return next((start + i for i, h in enumerate(hashes[start:end]) if not available(self.key(h))), end)


class SlidingWindow(GroupManager):
    """Attention within the last `window` positions: a query at position p reads keys from
    p - window + 1 on, so a long sequence holds about window / block_size + 1 blocks."""

    kind = "sliding"
    holds_every_block = False

    def first_needed_block(self, start: int) -> int:
        return max(0, start - self.window + 1) // self.block_size

    def num_blocks_to_hold(self, num_tokens: int, max_chunk: int | None = None) -> int:
        return blocks_to_hold((self.window,), num_tokens, self.block_size, max_chunk)

    def hit_length(self, hashes: list[bytes], start: int, end: int, available: Callable[[BlockKey], bool]) -> int:
        while end > start and not all(
            available(self.key(h)) for h in hashes[max(start, self.first_needed_block(end * self.block_size)) : end]
        ):
            end -= 1
        return end


class ShortConvState(SlidingWindow):
    """A short convolution's state (LFM2): each token's input to the convolution (B * x) kept in
    its slot, read back over the last `window` positions (the kernel's size) by the step that
    convolves. The recurrent state is thus the window's slots themselves: a chunk, a preempted
    request's recompute and a fork rebuild it as attention's K/V are rebuilt, and a cached prefix
    restores it exactly when the blocks of its last window - 1 positions are cached (the sliding
    window's hit rule), so no snapshot is taken and none can go stale."""

    kind = "conv"


# Every attention kind a KV group can have: a new kind is a GroupManager subclass and its entry here.
GROUP_KINDS: dict[str, type[GroupManager]] = {cls.kind: cls for cls in (FullAttention, SlidingWindow, ShortConvState)}


def kind_of(window: int | None, layer_kind: str = "attention") -> str:
    """The manager kind of a KV group from its window and layers' kind (config.KVGroup)."""
    if layer_kind == "conv":
        return "conv"
    return "full" if window is None else "sliding"


def make_group(group_id: int, kind: str, pool: BlockPool, block_size: int, window: int | None = None) -> GroupManager:
    if kind not in GROUP_KINDS:
        raise ValueError(f"no KV group manager for attention kind {kind!r} (known: {', '.join(GROUP_KINDS)})")
    return GROUP_KINDS[kind](group_id, pool, block_size, window)
