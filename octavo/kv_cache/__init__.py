"""Paged KV-cache bookkeeping in pure Python: the block pool, prefix hashes and the manager."""

from octavo.kv_cache.manager import Allocation, ComputedBlocks, KVCacheManager

__all__ = ["Allocation", "ComputedBlocks", "KVCacheManager"]
