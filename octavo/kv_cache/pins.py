"""PinnedPrefixes: prompt blocks kept in the pool for good (held by no request, never evicted)."""

from __future__ import annotations

from collections.abc import Callable

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock
from octavo.kv_cache.groups import BlockKey, GroupManager
from octavo.request import Request


class PinnedPrefixes:
    """The pinned blocks (each with its hash-map key, kept through a reset of the prefix cache),
    at most `max_blocks` of them. A later prompt that starts with a pinned prefix hits its blocks
    as any cached ones; they take nothing from the rest of the pool."""

    def __init__(self, pool: BlockPool, groups: list[GroupManager], block_hashes: Callable[[Request], list[bytes]]) -> None:
        self.pool = pool
        self.groups = groups
        self.block_hashes = block_hashes
        self.block_size = groups[0].block_size
        self.max_blocks = 0
        self._pinned: list[tuple[KVCacheBlock, BlockKey]] = []

    @property
    def num_blocks(self) -> int:
        return len(self._pinned)

    def block_ids(self) -> list[int]:
        return [block.block_id for block, _ in self._pinned]

    def _prompt_hashes(self, request: Request) -> list[bytes]:
        return self.block_hashes(request)[: request.num_prompt_tokens // self.block_size]

    def num_hits(self, request: Request) -> int:
        """Blocks of a request's tables that would be pinned blocks (its prompt starts with a
        pinned prefix) in the groups that keep every block. Changes nothing."""
        if not self._pinned:
            return 0
        keys = {key for _, key in self._pinned}
        hashes = self._prompt_hashes(request)
        return sum(next((i for i, h in enumerate(hashes) if g.key(h) not in keys), len(hashes))
                   for g in self.groups if g.holds_every_block)

    def num_to_pin(self, request: Request) -> int:
        """Blocks `pin` would add for a request that computes its whole prompt: its prompt's full
        blocks (per KV group) not pinned already."""
        keys = {key for _, key in self._pinned}
        hashes = self._prompt_hashes(request)
        return sum(g.key(h) not in keys for g in self.groups for h in hashes)

    def pin(self, request: Request) -> int:
        """Pin the full blocks of the request's prompt (it is ending; its output is not part of the
        prefix) that its tables still hold and the hash map finds, up to `max_blocks` in all
        (check `num_to_pin` first); blocks pinned already count once. Returns how many."""
        keys = {key for _, key in self._pinned}
        new = []
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        for g in self.groups:
            table = g.tables.get(request.request_id)
            for block in table.blocks[table.num_dropped : num_prompt_blocks] if table else ():
                key = None if block is None else block.block_hash
                if key is not None and key not in keys and self.pool.lookup(key) is block:
                    new.append((block, key))
                    keys.add(key)
        new = new[: max(0, self.max_blocks - len(self._pinned))]
        self.pool.touch([block for block, _ in new])
        self._pinned.extend(new)
        return len(new)

    def unpin_all(self) -> int:
        """Let every pinned block go (they stay cached, evictable as any other). Returns how many."""
        blocks = [block for block, _ in self._pinned]
        self._pinned = []
        self.pool.free(blocks[::-1])
        return len(blocks)

    def restore_hashes(self) -> None:
        """After the pool forgot every hash (a prefix-cache reset): make the pinned blocks findable again."""
        for block, key in self._pinned:
            self.pool.cache_block(block, key)
