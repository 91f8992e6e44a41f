"""The second KV tier in host memory: what a GPU server keeps its evicted blocks in (pinned, so the
copies between device and host are DMA transfers), and what `--kv-offload-medium host` gives a
CPU one (a RAM budget apart from the pool's, e.g. for a disk too slow or absent).

Same calls as DiskTier (octavo.kv_tier.disk), so the runner and the engine use either alike; but
nothing survives the process (no restart to serve, no fingerprint to check), and a block cannot
be torn by another process: each slot remembers the key written into it, and a read of a slot
that holds another key fails like a bad checksum. Copies are made on the caller's thread: a
memory copy of a block takes tens of microseconds, less than handing it to a thread.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

TierKey = tuple[int, bytes]


class HostTier:
    """`num_slots` slots of `slot_bytes` in one buffer (`buffer`: any writable buffer of at least
    num_slots * slot_bytes bytes, e.g. pinned memory; a bytearray by default)."""

    is_direct = False  # the DiskTier's O_DIRECT flag, for the same log line
    durable = False  # nothing is kept for a restart (a server's shutdown writes nothing here)
    num_write_waits = 0  # a copy never queues

    def __init__(self, slot_bytes: int, num_slots: int, buffer=None) -> None:
        if slot_bytes < 1 or num_slots < 1:
            raise ValueError(f"a host KV tier needs slots of at least one byte, got {num_slots} x {slot_bytes} B")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        mem = memoryview(buffer if buffer is not None else bytearray(slot_bytes * num_slots)).cast("B")
        if len(mem) < slot_bytes * num_slots:
            raise ValueError(f"the buffer holds {len(mem)} B, {num_slots} slots need {slot_bytes * num_slots} B")
        self._mem = mem
        self._keys: list[TierKey | None] = [None] * num_slots
        self._done_writes: list[tuple[int, bool]] = []
        self._closed = False

    def recover(self) -> list[tuple[TierKey, int]]:
        """Nothing: host memory starts empty."""
        return []

    def measure_round_trip(self, num_blocks: int = 8) -> float:
        """Seconds to copy one block into a slot and back (slots 0.. are scratch until written)."""
        num_blocks = min(num_blocks, self.num_slots)
        block = bytearray(self.slot_bytes)
        start = time.perf_counter()
        for slot in range(num_blocks):
            self._slot(slot)[:] = block
            block[:] = self._slot(slot)
        return (time.perf_counter() - start) / num_blocks

    def _slot(self, slot: int) -> memoryview:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside the tier's {self.num_slots}")
        return self._mem[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    # ---- the runner's calls (as DiskTier's) --------------------------------------------------

    def submit_writes(self, slots: list[int], keys: list[TierKey], buffers: list[memoryview]) -> None:
        """Copy each buffer (one block's bytes) into its slot; reported by take_finished_writes."""
        self._check(slots, keys, buffers)
        for slot, key, buf in zip(slots, keys, buffers):
            self._slot(slot)[:] = memoryview(buf).cast("B")
            self._keys[slot] = key
            self._done_writes.append((slot, True))

    def submit_reads(self, slots: list[int], keys: list[TierKey], buffers: list[memoryview]) -> Future:
        """Copy each slot into its buffer; the (already done) future's result says, per slot,
        whether the slot held `key`."""
        self._check(slots, keys, buffers)
        ok = []
        for slot, key, buf in zip(slots, keys, buffers):
            good = self._keys[slot] == key
            if good:
                memoryview(buf).cast("B")[:] = self._slot(slot)
            ok.append(good)
        future: Future = Future()
        future.set_result(ok)
        return future

    def take_finished_writes(self) -> list[tuple[int, bool]]:
        done, self._done_writes = self._done_writes, []
        return done

    def flush(self) -> None:
        """Nothing queues: every copy is done when its call returns."""

    def close(self) -> None:
        self._closed = True
        self._keys = [None] * self.num_slots

    def _check(self, slots, keys, buffers) -> None:
        if self._closed:
            raise RuntimeError("the KV tier is closed")
        if not len(slots) == len(keys) == len(buffers):
            raise ValueError("slots, keys and buffers must be as many")
