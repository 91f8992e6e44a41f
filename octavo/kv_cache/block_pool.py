"""The block pool: every KV block's reference count, the free queue in eviction order, the hash map.

Pure Python. Only `KVCacheManager` calls it.

Eviction order. The free queue holds every block with ref_cnt 0, front evicted first:
  * a freed block that carries a hash (its content is reusable) goes to the tail: least recently
    used blocks are at the front;
  * a freed block without a hash (partial, or caching off) goes to the front: nothing is lost by
    reusing it at once;
  * callers free a request's blocks in reverse table order, so among blocks freed together the
    tail of a chain is evicted before its head (a head is shared by more future prompts).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from octavo.kv_cache.events import MEDIUM_POOL


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None  # its key in the hash map: (KV group, chained hash) from the manager
    # Links of the doubly linked free queue; None when the block is not in the queue.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash
        if isinstance(h, tuple):
            h = f"{h[0]}:{h[1].hex()[:8]}"
        elif isinstance(h, bytes):
            h = h.hex()[:8]
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, prepend, pop-front and remove-anywhere.

    remove() is what a prefix-cache hit on a free block needs: the block leaves the queue without
    a scan.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinels; never handed out
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._link_after(prev, block)

    def prepend(self, block: KVCacheBlock) -> None:
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        """Free block ids, front (next evicted) first. For tests and debugging."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Owns all blocks: allocation, reference counts, freeing, and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[Hashable, KVCacheBlock] = {}
        # (block id, hash-map key) of each cached content evicted by `allocate`, oldest first,
        # when someone (a second KV tier) wants to keep it: None records nothing.
        self.evicted: list[tuple[int, object]] | None = None
        # blocks whose content is not worth keeping there (a preempted request that recomputes
        # rather than swaps): evicted without being recorded, unless a hit reuses them first
        self.skip_offload: set[int] = set()
        # every change of the hash map, in order, as (medium, stored?, key), when someone (the KV
        # event log, kv_cache/events.py) wants them: None records nothing
        self.changes: list | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, possibly still holding evictable cached content)."""
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Share of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the front of the free queue, evicting their cached content.

        Raises ValueError when fewer are free; callers check `num_free_blocks` first.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.changes is not None:
                    self.changes.append((MEDIUM_POOL, False, block.block_hash))
                if self.evicted is not None and block.block_id not in self.skip_offload:
                    self.evicted.append((block.block_id, block.block_hash))
            block.block_hash = None
        self.skip_offload.discard(block.block_id)

    def lookup(self, block_hash: Hashable) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on each block (a cache hit or a fork); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            self.skip_offload.discard(block.block_id)

    def cache_block(self, block: KVCacheBlock, block_hash: Hashable) -> None:
        """Record that `block` holds the full block whose chained hash is `block_hash`.

        If another block already holds that content, the map keeps the first one: later lookups
        share it, and this block simply carries its hash until it is freed and evicted.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            if self.changes is not None:
                self.changes.append((MEDIUM_POOL, True, block_hash))

    def free(self, blocks_in_eviction_order: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 enter the free queue.

        The caller passes blocks in the order they should be evicted (a request's table reversed).
        """
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                    self.free_queue.append(block)
                else:
                    # Not reachable through the map: its content can never be hit, reuse it first.
                    block.block_hash = None
                    self.free_queue.prepend(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash, so no later request can hit today's content. Returns how many.

        Blocks held by running requests keep their content and simply stop being shareable.
        """
        num_forgotten = len(self.cached)
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return num_forgotten
