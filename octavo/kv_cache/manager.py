"""KVCacheManager: the only KV-cache API the scheduler calls (block tables, prefix hits, forks, CoW)."""

from __future__ import annotations

from dataclasses import dataclass, field

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.prefix_cache import extend_block_hashes
from octavo.request import Request


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix-cache hit: the shared blocks and the number of tokens they cover (block-aligned)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass(slots=True)
class Allocation:
    """What the scheduler learns from a successful `allocate_slots`.

    block_ids is the request's whole block table (read-only for the caller). copies lists
    (src_block_id, dst_block_id) pairs the model runner must copy before this step's forward:
    copy-on-write of a partly filled block shared with a sibling sequence.
    """

    block_ids: list[int]
    copies: list[tuple[int, int]]


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries_tokens: int = 0
    num_hits_tokens: int = 0


class KVCacheManager:
    """Keeps each request's block table and hashes on top of a BlockPool.

    Invariants: every block is either in the free queue (ref_cnt 0) or held; a block's ref_cnt
    equals the number of tables that contain it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._tables: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Full blocks scheduled in this step but not yet computed: rid -> their hashes, and how
        # many requests are computing each hash. A waiting request whose next block is among
        # them waits one step and then hits it, rather than computing the same KV twice.
        self._in_flight: dict[str, list[bytes]] = {}
        self._num_in_flight: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    # ---- reads -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_ids.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(
                hashes, request.all_token_ids, self.block_size, request.cache_salt, request.lora_cache_key,
            )
        return hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest chain of cached full blocks that prefixes the request; changes nothing.

        The hit never covers the last token: its logits must be computed, so a request whose
        whole prompt is cached still recomputes its last block.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedBlocks()  # prompt logprobs need every prompt position computed (vLLM v1 does the same)
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return ComputedBlocks(hit)

    # ---- writes ------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Grow the request's table so tokens [start, start + num_new_tokens) have slots.

        start is request.num_computed_tokens, or the hit's length when `computed` is given (a
        request being admitted, whose table must be empty). Returns None and changes nothing
        when the pool cannot supply the blocks. Nothing is entered into the prefix cache here:
        a block becomes shareable only once its tokens are computed (`cache_blocks`, after the
        step), so a request preempted after being scheduled cannot leave hashes on blocks whose
        KV was never written.

            table:  | full | full | part |  new  |  new  |
                                  ^start        ^start + num_new_tokens
            a shared `part` block is copied first (copy-on-write); full blocks are never copied.
        """
        rid = request.request_id
        table = self._tables.setdefault(rid, [])
        block_ids = self._block_ids.setdefault(rid, [])
        hit_blocks = computed.blocks if computed is not None else []
        if hit_blocks and table:
            raise ValueError(f"request {rid} already holds blocks; a prefix hit applies only on admission")
        start = len(hit_blocks) * self.block_size if computed is not None else request.num_computed_tokens
        end = start + num_new_tokens

        num_new_blocks = max(0, self.num_blocks_for(end) - len(table) - len(hit_blocks))
        write_idx = start // self.block_size
        needs_copy = (
            start % self.block_size != 0
            and write_idx < len(table)
            and table[write_idx].ref_cnt > 1
        )
        num_hits_now_free = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_new_blocks + int(needs_copy) + num_hits_now_free > self.pool.num_free_blocks:
            return None

        if computed is not None:
            self.stats.num_queries_tokens += request.num_tokens
            self.stats.num_hits_tokens += len(hit_blocks) * self.block_size
        self.pool.touch(hit_blocks)
        table.extend(hit_blocks)
        block_ids.extend(block.block_id for block in hit_blocks)
        self._num_cached_blocks[rid] = max(self._num_cached_blocks.get(rid, 0), len(hit_blocks))

        copies: list[tuple[int, int]] = []
        if needs_copy:
            shared = table[write_idx]
            (private,) = self.pool.allocate(1)
            copies.append((shared.block_id, private.block_id))
            self.pool.free([shared])
            table[write_idx] = private
            block_ids[write_idx] = private.block_id
        if num_new_blocks:
            new_blocks = self.pool.allocate(num_new_blocks)
            table.extend(new_blocks)
            block_ids.extend(block.block_id for block in new_blocks)
        self._mark_in_flight(request, end)
        return Allocation(block_ids, copies)

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
        idx = len(computed.blocks)
        return idx < min(len(hashes), (request.num_tokens - 1) // self.block_size) and hashes[idx] in self._num_in_flight

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within its first `num_computed_tokens` tokens
        into the prefix cache. Call only once the forward has written those tokens' KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        self._clear_in_flight(rid)
        table = self._tables.get(rid)
        if table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        first = self._num_cached_blocks.get(rid, 0)
        if num_full <= first:
            return
        hashes = self._block_hashes(request)
        for block_idx in range(first, num_full):
            self.pool.cache_block(table[block_idx], hashes[block_idx])
        self._num_cached_blocks[rid] = num_full

    def fork(self, parent: Request, child: Request) -> list[int]:
        """Give `child` the parent's whole table by reference (ref counts +1); returns its block ids."""
        table = list(self._tables[parent.request_id])
        self.pool.touch(table)
        self._tables[child.request_id] = table
        self._block_ids[child.request_id] = [block.block_id for block in table]
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)
        return self._block_ids[child.request_id]

    def free(self, request: Request) -> None:
        """Return all the request's blocks (tail of the table first, so chains evict tail-first).

        The block hashes are kept: a preempted request recomputes the same tokens and can hit
        its own cached prefix. `remove` forgets them once the request has ended.
        """
        rid = request.request_id
        self._clear_in_flight(rid)
        table = self._tables.pop(rid, [])
        self._block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self.pool.free(table[::-1])

    def remove(self, request: Request) -> None:
        """Free the request's blocks and forget everything kept about it."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

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
        for table in self._tables.values():
            for block in table:
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
        return problems
