"""KV events: the prefix cache's changes (block stored, block removed, all cleared) in vLLM's terms.

Pure Python. The block pool and the second tier's index append each change of their hash maps to
one shared list (`KVEventLog.changes`) as it happens; the manager gives the log each block's
tokens when it makes the block's hash; `drain` turns a step's changes into events. A subscriber
that applies the events in order holds exactly the keys of `BlockPool.cached` (medium GPU: the
engine's own pool, on whatever device) and the tier's ready entries (medium CPU for host memory,
DISK for a disk tier). kv_events.py encodes and publishes them.

Only hash-map changes are events: a second block holding content the map already has (it carries
the hash but is never looked up) stores and removes nothing, so every Stored is followed by at
most one Removed of the same key in the same medium, and a subscriber's set never drifts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

MEDIUM_POOL = "GPU"  # vLLM's name for the engine's own KV pool (on the CPU here as well)

# one change of a hash map: (medium, stored? , key); key = (KV group, chained hash)
Change = tuple[str, bool, Hashable]
_CLEARED: Change = ("", False, None)  # every medium emptied at once (a prefix-cache reset)


def hash_as_int(block_hash: bytes) -> int:
    """vLLM's integer form of a block hash (its default on the wire): the last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(slots=True, frozen=True)
class BlockInfo:
    """What a published block carries besides its hash: enough to recompute the hash."""

    parent_hash: bytes | None  # None: the first block of its chain
    token_ids: tuple[int, ...]
    extra_keys: tuple | None  # as prefix_cache.block_extra_keys
    lora_id: int | None


@dataclass(slots=True)
class BlockStored:
    """Blocks of one chain entered into a medium, in chain order (each one's parent is the one
    before it; the first's is `parent_hash`). `token_ids`: every block's tokens, concatenated;
    empty when they are no longer known (a tier store long after the pool held it)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    group_idx: int
    lora_id: int | None = None
    extra_keys: list[tuple | None] | None = None  # one per block; None when every block has none


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str
    group_idx: int


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """The changes since the last `drain`, and the tokens of recently hashed blocks.

    `info_capacity`: blocks whose tokens are remembered (least recently hashed forgotten first);
    twice the blocks the pool and tier hold keeps every block's tokens until its stores."""

    block_size: int
    info_capacity: int
    changes: list[Change] = field(default_factory=list)
    _info: OrderedDict[bytes, BlockInfo] = field(default_factory=OrderedDict)

    def describe(self, block_hash: bytes, info: BlockInfo) -> None:
        """Remember a block's tokens (its hash was just made)."""
        self._info[block_hash] = info
        self._info.move_to_end(block_hash)
        if len(self._info) > self.info_capacity:
            self._info.popitem(last=False)

    def record_cleared(self) -> None:
        self.changes.append(_CLEARED)

    def record_stored(self, medium: str, keys) -> None:
        """Announce keys a medium holds already (at start, and what a reset keeps)."""
        self.changes.extend((medium, True, key) for key in keys)

    def drain(self) -> list[KVEvent]:
        """The changes since the last call as events, in order; a run of stores into one medium
        and group whose blocks chain (each the next one's parent) becomes one BlockStored, a run of
        removals one BlockRemoved."""
        events: list[KVEvent] = []
        for medium, stored, key in self.changes:
            if key is None:
                events.append(AllBlocksCleared())
                continue
            group_idx, block_hash = key
            last = events[-1] if events else None
            if not stored:
                if isinstance(last, BlockRemoved) and (last.medium, last.group_idx) == (medium, group_idx):
                    last.block_hashes.append(block_hash)
                else:
                    events.append(BlockRemoved([block_hash], medium, group_idx))
                continue
            info = self._info.get(block_hash)
            if info is not None:
                self._info.move_to_end(block_hash)
            tokens = list(info.token_ids) if info is not None else []
            extra = info.extra_keys if info is not None else None
            if (isinstance(last, BlockStored) and (last.medium, last.group_idx) == (medium, group_idx)
                    and info is not None and info.parent_hash == last.block_hashes[-1]
                    and info.lora_id == last.lora_id and len(last.token_ids) == len(last.block_hashes) * self.block_size):
                last.block_hashes.append(block_hash)
                last.token_ids.extend(tokens)
                if last.extra_keys is not None or extra is not None:
                    last.extra_keys = (last.extra_keys or [None] * (len(last.block_hashes) - 1)) + [extra]
                continue
            events.append(BlockStored(
                [block_hash], info.parent_hash if info is not None else None, tokens, self.block_size, medium,
                group_idx, info.lora_id if info is not None else None, None if extra is None else [extra]))
        self.changes.clear()
        return events


def apply_events(index: set[tuple[str, int, bytes]], events: Sequence[KVEvent]) -> None:
    """Apply events to a set of (medium, group, hash): what a subscriber keeps (tests use it to
    check the log against the pool)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            index.clear()
        elif isinstance(event, BlockStored):
            index.update((event.medium, event.group_idx, h) for h in event.block_hashes)
        else:
            index.difference_update((event.medium, event.group_idx, h) for h in event.block_hashes)
