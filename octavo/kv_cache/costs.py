"""What the scheduler's policies ask of the KV cache: the tokens a waiting request would reuse
(cache-aware admission), what preempting a running one would cost (the victim rule), and the
blocks the running requests grow into soon (admission headroom).

Reads only; pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.kv_cache.manager import KVCacheManager
from octavo.request import Request


def num_reusable_tokens(kv: KVCacheManager, request: Request) -> int:
    """Tokens of the request's prefix its admission would take from the cache now: the pool,
    and the second tier where there is one. Changes nothing but the request's hashes."""
    return reusable_tokens_counter(kv)(request)


def reusable_tokens_counter(kv: KVCacheManager) -> Callable[[Request], int]:
    """`num_reusable_tokens` for many requests at one moment (the cache must not change while
    it is used): a walk of each request's block hashes up to its first miss, except that a
    request whose chain matches one counted before through that one's last hit starts there
    (requests of one system prompt cost one walk between them, then a comparison each)."""
    bs, num_lookup, block_hashes = kv.block_size, kv.num_lookup_blocks, kv.block_hashes
    available = kv.is_in_pool if kv.connector is None else kv.is_cached
    if len(kv.groups) > 1 or not kv.groups[0].holds_every_block:
        return lambda r: kv.reach(block_hashes(r)[: num_lookup(r)], 0, num_lookup(r), available) * bs
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
        while num_hit < num and available((0, hashes[num_hit])):
            num_hit += 1
        last[hashes[0]] = (hashes, num_hit, num)
        return num_hit * bs
    return count


def preemption_cost(kv: KVCacheManager, request: Request) -> tuple[int, int]:
    """What preempting a running request would cost and give back: (tokens it would compute
    again, or with a second tier that takes preempted blocks the blocks it would write there;
    blocks freed). Only blocks it alone holds count: shared ones stay held; a full block the
    tier already has costs nothing; a partial block is always recomputed. Changes nothing."""
    bs = kv.block_size
    swaps = kv.connector is not None and kv.connector.swap_preempted
    cost = num_freed = 0
    for g in kv.groups:
        table = g.tables.get(request.request_id)
        for idx in range(table.num_dropped, len(table.blocks)) if table else ():
            block = table.blocks[idx]
            if block is None or block.ref_cnt != 1:
                continue
            num_freed += 1
            num_tokens = min(bs, max(0, request.num_computed_tokens - idx * bs))
            if block.block_hash is None or not swaps:
                cost += num_tokens
            elif not kv.connector.can_supply(block.block_hash):
                cost += 1  # one block to write (and read back): far cheaper than recomputing it
    return cost, num_freed


def growth_blocks(kv: KVCacheManager, running: list[Request], num_steps: int) -> int:
    """New blocks the running requests take over their next `num_steps` tokens each (none past
    their max_tokens). O(running)."""
    if num_steps == 0:
        return 0
    bs, total = kv.block_size, 0
    for r in running:
        max_tokens = r.sampling_params.max_tokens
        left = num_steps if max_tokens is None else min(num_steps, r.num_prompt_tokens + max_tokens - r.num_tokens)
        total += -(-(r.num_tokens + left) // bs) - -(-r.num_tokens // bs)
    return total
