"""The second KV tier's index: which block contents sit in which slot of the tier, in LRU order.

Pure Python. The tier (files on local disk; see octavo/kv_tier) holds `num_slots` blocks; this
index knows, for each (KV group, chained block hash), the slot holding it. The runner moves the
bytes; the KVCacheManager decides what moves. An entry's life:

    reserve() -> WRITING (the runner is writing it; invisible to lookups, never evicted)
    commit(ok) -> READY (found by lookups; evicted least recently used first when a slot is
                  needed), or gone if the write failed
    pin() while a load reads it (never evicted meanwhile), unpin() after
    drop() when a load found it corrupt (checksum): gone, never served

A write that fails for want of space shrinks the tier to what it holds (a warning, never a failed
request): `num_slots` only ever goes down.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

TierKey = tuple[int, bytes]  # (KV group, chained block hash): the tenant's salt and LoRA id are in the hash


@dataclass(slots=True)
class TierEntry:
    slot: int
    is_ready: bool = False
    num_pins: int = 0


@dataclass(slots=True)
class TierStats:
    """Cumulative counters (blocks) since start."""

    num_stored: int = 0  # writes committed
    num_store_failed: int = 0
    num_loaded: int = 0  # loads that passed their checksum
    num_corrupt: int = 0  # loads dropped by their checksum
    num_evicted: int = 0  # READY entries pushed out by newer ones
    num_skipped: int = 0  # offers refused: every slot was being written or read


class TierIndex:
    """Slot assignment and LRU of the second tier. Capacity `num_slots` blocks (may shrink)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[TierKey, TierEntry] = OrderedDict()  # least recently used first
        self._by_slot: dict[int, TierKey] = {}
        self._free: list[int] = list(range(num_slots))  # a heap: low slots first, so batches are contiguous
        self.stats = TierStats()
        # READY entries coming and going, in order, as (medium, stored?, key), for the KV event
        # log (kv_cache/events.py); None records nothing
        self.changes: list | None = None
        self.medium = "DISK"  # what the events call this tier (CPU: host memory)

    # ---- reads -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Entries held (ready or being written)."""
        return len(self._entries)

    def __contains__(self, key: TierKey) -> bool:
        """Whether `key` is held, ready or being written (it need not be offered again)."""
        return key in self._entries

    def lookup(self, key: TierKey) -> int | None:
        """The slot of a READY entry, else None. Changes nothing."""
        entry = self._entries.get(key)
        return entry.slot if entry is not None and entry.is_ready else None

    def usage(self) -> float:
        """Share of the tier's (current) capacity held."""
        return len(self._entries) / self.num_slots if self.num_slots else 1.0

    def slot_states(self) -> str:
        """One character per slot (up to the highest held, should the tier have shrunk below it):
        `.` empty, `w` being written, `r` ready, `l` being read by a load (pinned). O(slots);
        changes nothing."""
        states = ["."] * max([self.num_slots] + [e.slot + 1 for e in self._entries.values()])
        for entry in self._entries.values():
            states[entry.slot] = "l" if entry.num_pins else "r" if entry.is_ready else "w"
        return "".join(states)

    # ---- writes ------------------------------------------------------------------------------

    def reserve(self, key: TierKey) -> int | None:
        """A slot for writing `key`'s block (the entry is WRITING until `commit`), evicting the
        least recently used READY, unpinned entry when no slot is free. None when `key` is held
        already or no slot can be had (all being written or read)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        slot = self._take_slot()
        if slot is None:
            self.stats.num_skipped += 1
            return None
        self._entries[key] = TierEntry(slot)
        self._by_slot[slot] = key
        return slot

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for key, entry in self._entries.items():
            if entry.is_ready and entry.num_pins == 0:
                self._remove(key, free_slot=False)
                self.stats.num_evicted += 1
                return entry.slot
        return None

    def commit(self, slot: int, ok: bool) -> None:
        """The runner's report on a write: READY when `ok`; else the entry is gone and the tier
        shrinks to what it holds (the disk is full or failing: stop offering new blocks)."""
        key = self._by_slot.get(slot)
        if key is None or self._entries[key].is_ready:
            raise ValueError(f"tier slot {slot} has no write in flight")
        if ok:
            self._entries[key].is_ready = True
            self.stats.num_stored += 1
            if self.changes is not None:
                self.changes.append((self.medium, True, key))
            return
        self._remove(key, free_slot=False)  # never written again
        self.stats.num_store_failed += 1
        self._free = []  # from now on only slots already written are reused (they need no new space)
        self.num_slots = max(1, len(self._entries))

    def touch(self, key: TierKey) -> None:
        """Mark a READY entry most recently used (a hit)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def pin(self, key: TierKey) -> int:
        """Hold a READY entry against eviction while a load reads it; returns its slot."""
        entry = self._entries.get(key)
        if entry is None or not entry.is_ready:
            raise ValueError(f"no ready tier entry for group {key[0]} hash {key[1].hex()[:12]}")
        entry.num_pins += 1
        self._entries.move_to_end(key)
        return entry.slot

    def unpin(self, key: TierKey, ok: bool) -> None:
        """A load of `key` ended: `ok` False (a bad checksum) drops the entry for good."""
        entry = self._entries[key]
        entry.num_pins -= 1
        if ok:
            self.stats.num_loaded += 1
        else:
            self.stats.num_corrupt += 1
            if entry.num_pins == 0:
                self._remove(key)

    def restore(self, entries: list[tuple[TierKey, int]]) -> int:
        """Enter READY entries found on disk at start (oldest first: they become least recently
        used first). Slots outside the capacity or already taken are skipped. Returns how many
        were entered."""
        taken = 0
        for key, slot in entries:
            if slot >= self.num_slots or slot in self._by_slot or key in self._entries:
                continue
            self._entries[key] = TierEntry(slot, is_ready=True)
            self._by_slot[slot] = key
            taken += 1
        held = set(self._by_slot)
        self._free = [s for s in range(self.num_slots) if s not in held]
        heapq.heapify(self._free)
        return taken

    def clear(self) -> int:
        """Forget every READY, unpinned entry (a prefix-cache reset). Returns how many."""
        gone = [k for k, e in self._entries.items() if e.is_ready and e.num_pins == 0]
        for key in gone:
            self._remove(key)
        return len(gone)

    def ready_keys(self) -> list[TierKey]:
        """The READY entries' keys, least recently used first."""
        return [k for k, e in self._entries.items() if e.is_ready]

    def _remove(self, key: TierKey, free_slot: bool = True) -> None:
        entry = self._entries.pop(key)
        if entry.is_ready and self.changes is not None:
            self.changes.append((self.medium, False, key))
        del self._by_slot[entry.slot]
        if free_slot:
            heapq.heappush(self._free, entry.slot)

    def check_invariants(self) -> list[str]:
        """Problems found (empty when sound): each slot held by one key at most, free and held
        slots disjoint, and the entries within the capacity."""
        problems = []
        slots = [e.slot for e in self._entries.values()]
        if len(slots) != len(set(slots)):
            problems.append("a tier slot is held by two keys")
        if set(slots) & set(self._free):
            problems.append("a held tier slot is also free")
        if len(self._entries) > self.num_slots:
            problems.append(f"{len(self._entries)} entries in a tier of {self.num_slots} slots")
        if {self._by_slot[e.slot] for e in self._entries.values()} != set(self._entries):
            problems.append("slot -> key map out of step with the entries")
        return problems
