"""An independent KV-event subscriber for the tests: decodes docs/API.md's schema with msgspec
structs written here (nothing of Octavo's encoder is imported), keeps the index a router would
keep, recomputes sha256_cbor hashes with cbor2 from the tokens, and catches up through the replay
socket after a restart."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import cbor2
import msgspec
import zmq


class StoredEvent(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class RemovedEvent(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class ClearedEvent(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[StoredEvent | RemovedEvent | ClearedEvent]
    data_parallel_rank: int | None = None


def cbor_block_hash(parent: bytes | None, tokens: list[int], extra: object = None) -> bytes:
    """docs/API.md's recipe: the chain's root is sha256(cbor(PYTHONHASHSEED, else the seed string))."""
    seed = os.environ.get("PYTHONHASHSEED") or "octavo-prefix-cache-v1"
    root = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    return hashlib.sha256(cbor2.dumps((parent or root, tuple(tokens), extra), canonical=True)).digest()


class Subscriber:
    """SUB on `endpoint` in a thread; `index` holds (medium, group, hash). Tracks sequence gaps
    and hashes that do not recompute (raw 32-byte hashes only)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.index: set[tuple[str, int, int | bytes]] = set()
        self.last_seq = -1
        self.num_gaps = 0
        self.num_batches = 0
        self.num_checked = 0
        self.bad_hashes: list[str] = []
        self._decoder = msgspec.msgpack.Decoder(Batch)
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, catch_up: bool = False) -> None:
        self._stop.clear()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)
        if catch_up:
            self.replay(self.last_seq + 1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._sub.close(linger=0)

    def replay(self, start_seq: int) -> int:
        """Ask the replay socket for every batch from `start_seq`; apply them; return how many."""
        req = self._ctx.socket(zmq.DEALER)
        req.connect(self.replay_endpoint)
        req.send_multipart([b"", start_seq.to_bytes(8, "big")])
        n = 0
        try:
            while True:
                if not req.poll(30_000):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} in 30 s")
                _, seq, payload = req.recv_multipart()
                seq_no = int.from_bytes(seq, "big", signed=True)
                if seq_no == -1:
                    return n
                self._apply(seq_no, payload)
                n += 1
        finally:
            req.close(linger=0)

    def wait_for(self, predicate, timeout_s: float = 60.0, what: str = "events") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return
            time.sleep(0.05)
        raise AssertionError(f"subscriber waited {timeout_s} s for {what}; last sequence {self.last_seq}")

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            _topic, seq, payload = self._sub.recv_multipart()
            self._apply(int.from_bytes(seq, "big"), payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        with self._lock:
            if seq <= self.last_seq:
                return  # a batch seen already (replay overlapping the live stream)
            if seq != self.last_seq + 1:
                self.num_gaps += 1
            self.last_seq = seq
            self.num_batches += 1
            for event in self._decoder.decode(payload).events:
                if isinstance(event, ClearedEvent):
                    self.index.clear()
                elif isinstance(event, StoredEvent):
                    self._check(event)
                    self.index.update((event.medium, event.group_idx, h) for h in event.block_hashes)
                else:
                    self.index.difference_update((event.medium, event.group_idx, h) for h in event.block_hashes)

    def _check(self, event: StoredEvent) -> None:
        """Recompute each block's hash from its parent and tokens (raw hashes, no extra keys)."""
        if not event.token_ids or not isinstance(event.block_hashes[0], bytes) or event.extra_keys:
            return
        parent = event.parent_block_hash
        size = event.block_size
        for i, h in enumerate(event.block_hashes):
            want = cbor_block_hash(parent, event.token_ids[i * size:(i + 1) * size])
            self.num_checked += 1
            if want != h:
                self.bad_hashes.append(h.hex()[:16])
            parent = h
