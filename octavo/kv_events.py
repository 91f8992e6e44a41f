"""Publishing KV events over ZMQ in vLLM's msgpack layout (docs/API.md, "KV events").

The engine drains its KV event log (kv_cache/events.py) after each step and hands the step's
events here; a batch is encoded on the engine's thread (cheap: plain lists and dicts) and sent by a
publisher thread, which also answers replay requests. Wire protocol, as vLLM's publisher:
  * PUB socket: multipart (topic, sequence number as 8 bytes big-endian, msgpack payload); the
    sequence starts at 0 and rises by one per batch;
  * ROUTER replay socket: a subscriber sends (empty frame, start sequence as 8 bytes big-endian)
    from a DEALER or REQ socket and gets back every buffered batch from there as (empty frame?,
    sequence, payload) multiparts, then the sequence -1 with an empty payload.
pyzmq and msgspec are optional (pip install 'octavo[kv-events]'); only an engine started with
events on imports them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from octavo.config import KVEventsConfig
from octavo.kv_cache.events import AllBlocksCleared, BlockStored, KVEvent, hash_as_int

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _missing(what: str) -> ImportError:
    return ImportError(f"KV events need {what}: pip install 'octavo[kv-events]' (pyzmq and msgspec)")


class GroupSpec:
    """What a KV group's stored events say of its attention (vLLM's kv_cache_spec_* fields)."""

    __slots__ = ("kind", "window")

    def __init__(self, kind: str, window: int | None) -> None:
        self.kind = kind
        self.window = window


def group_specs(windows: Sequence[int | None], kinds: Sequence[str]) -> list[GroupSpec]:
    """vLLM's kind names for the engine's KV groups (config.kv_groups): full_attention,
    sliding_window (with the window), or the group's own kind (a recurrent state)."""
    out = []
    for window, kind in zip(windows, kinds):
        if kind == "attention":
            out.append(GroupSpec("full_attention" if window is None else "sliding_window", window))
        else:
            out.append(GroupSpec(kind, window))
    return out


class BatchEncoder:
    """Events -> one msgpack payload: [ts, [event, ...], data_parallel_rank], each event a map
    tagged by "type" (or, encoding "array", a list with the tag first and every field in order)."""

    def __init__(self, config: KVEventsConfig, specs: Sequence[GroupSpec],
                 lora_name: Callable[[int], str | None] = lambda lora_id: None) -> None:
        try:
            import msgspec
        except ImportError:
            raise _missing("msgspec") from None
        self._encoder = msgspec.msgpack.Encoder()
        self.as_int = config.hash_format == "int"
        self.as_array = config.encoding == "array"
        self.specs = list(specs)
        self.lora_name = lora_name

    def wire_hash(self, block_hash: bytes | None) -> int | bytes | None:
        if block_hash is None or not self.as_int:
            return block_hash
        return hash_as_int(block_hash)

    def encode(self, events: Sequence[KVEvent], ts: float | None = None) -> bytes:
        return self._encoder.encode([time.time() if ts is None else ts, [self._event(e) for e in events], 0])

    def _event(self, event: KVEvent) -> dict | list:
        if isinstance(event, AllBlocksCleared):
            return ["AllBlocksCleared"] if self.as_array else {"type": "AllBlocksCleared"}
        hashes = [self.wire_hash(h) for h in event.block_hashes]
        if not isinstance(event, BlockStored):
            fields = {"block_hashes": hashes, "medium": event.medium, "group_idx": event.group_idx}
            return ["BlockRemoved", *fields.values()] if self.as_array else {"type": "BlockRemoved", **fields}
        spec = self.specs[event.group_idx] if event.group_idx < len(self.specs) else GroupSpec("full_attention", None)
        fields = {
            "block_hashes": hashes, "parent_block_hash": self.wire_hash(event.parent_hash),
            "token_ids": event.token_ids, "block_size": event.block_size if event.token_ids else 0,
            "lora_id": event.lora_id, "medium": event.medium,
            "lora_name": None if event.lora_id is None else self.lora_name(event.lora_id),
            "extra_keys": None if event.extra_keys is None else [None if k is None else _plain(k) for k in event.extra_keys],
            "group_idx": event.group_idx, "kv_cache_spec_kind": spec.kind, "kv_cache_spec_sliding_window": spec.window,
        }
        if self.as_array:
            return ["BlockStored", *fields.values()]
        # vLLM's structs omit fields at their default (None) past the required ones
        optional = ("extra_keys", "kv_cache_spec_sliding_window")
        return {"type": "BlockStored", **{k: v for k, v in fields.items() if v is not None or k not in optional}}


def _plain(keys: tuple) -> list:
    """Extra keys (nested tuples) as lists: what msgpack carries."""
    return [_plain(k) if isinstance(k, tuple) else k for k in keys]


class NullPublisher:
    def publish(self, payload: bytes) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqPublisher:
    """PUB socket plus an optional ROUTER replay socket and a buffer of the last `buffer_steps`
    batches, served by one thread. `publish` never blocks the engine: past `max_queue_size`
    batches waiting, the oldest waiting batch is dropped (its sequence number is not used, so a
    subscriber sees no gap it cannot explain: it was never sent) and a warning logged."""

    SHUTDOWN_TIMEOUT_S = 2.0

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import zmq
        except ImportError:
            raise _missing("pyzmq") from None
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_sent = 0  # batches sent: the next sequence number
        self.num_dropped = 0
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="octavo-kv-events", daemon=True)
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        while True:
            try:
                self._queue.put_nowait(payload)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self.num_dropped += 1
                    if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                        logger.warning("KV events: %d batches dropped (the publisher cannot keep up)", self.num_dropped)
                except queue.Empty:
                    pass

    def shutdown(self) -> None:
        """Send what is queued (up to SHUTDOWN_TIMEOUT_S), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except self._zmq.ZMQError:
                    logger.exception("KV events: a replay request failed")
            try:
                payload = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq = self.num_sent
            self.num_sent += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed (it stays in the replay buffer)", seq)
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (want identity, empty, 8-byte sequence)",
                           len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig) -> ZmqPublisher | NullPublisher:
    return ZmqPublisher(config) if config.is_on and config.publisher == "zmq" else NullPublisher()


class KVEventStream:
    """An engine's KV events end to end: its manager's log, the encoder, the publisher. `flush`
    after each step (and after a prefix-cache reset) sends what changed as one batch, if anything
    did; also counts the seconds it spends (the cost docs/BENCHMARKS.md reports)."""

    def __init__(self, log, encoder: BatchEncoder, publisher: ZmqPublisher | NullPublisher) -> None:
        self.log = log
        self.encoder = encoder
        self.publisher = publisher
        self.num_batches = 0
        self.num_events = 0
        self.seconds = 0.0

    def flush(self) -> None:
        start = time.perf_counter()
        events = self.log.drain()
        if events:
            self.publisher.publish(self.encoder.encode(events))
            self.num_batches += 1
            self.num_events += len(events)
        self.seconds += time.perf_counter() - start

    def close(self) -> None:
        self.flush()
        self.publisher.shutdown()
