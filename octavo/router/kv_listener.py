"""The router's subscriptions to its replicas' KV events: one thread, one SUB socket per replica.

At start, and whenever a batch's sequence number skips, the listener asks the replica's replay
socket for what it missed (a replica's stream opens with AllBlocksCleared, so a replay from 0
rebuilds its whole index). A replica that restarts begins again at sequence 0: the listener sees
the number go back, forgets the replica and takes the new stream from its start. Batches feed
KVBlockIndex. Needs pyzmq and msgspec (pip install 'octavo[kv-events]').
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from octavo.router.kv_index import KVBlockIndex, decode_batch

logger = logging.getLogger("octavo.router")


@dataclass(slots=True)
class EventSource:
    replica: str  # the replica's URL (what the index and the router call it)
    endpoint: str  # its PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # its ROUTER replay socket
    last_seq: int = -1
    num_gaps: int = 0  # gaps the replay could not fill


class KVEventListener:
    def __init__(self, index: KVBlockIndex, sources: list[EventSource], topic: str = "") -> None:
        try:
            import msgspec
            import zmq
        except ImportError:
            raise ImportError("--policy kv-events needs pyzmq and msgspec: pip install 'octavo[kv-events]'") from None
        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder().decode
        self.index, self.sources, self.topic = index, sources, topic.encode()
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="octavo-router-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        sockets = {}
        for src in self.sources:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(src.endpoint)
            poller.register(sub, zmq.POLLIN)
            sockets[sub] = src
            self._replay(src, 0)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    frames = sock.recv_multipart()
                    if len(frames) == 3:
                        self._take(sockets[sock], int.from_bytes(frames[1], "big"), frames[2])
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def _take(self, src: EventSource, seq: int, payload: bytes) -> None:
        if seq <= src.last_seq:
            if seq < src.last_seq - 1 and seq == 0:  # the replica restarted: a new stream
                logger.info("KV events of %s restarted at sequence 0", src.replica)
                self.index.forget(src.replica)
                src.last_seq = -1
            else:
                return
        if seq > src.last_seq + 1 and src.replay_endpoint is not None:
            self._replay(src, src.last_seq + 1, upto=seq)
        if seq > src.last_seq + 1:
            src.num_gaps += 1
            logger.warning("KV events of %s: batches %d-%d missed", src.replica, src.last_seq + 1, seq - 1)
        self._apply(src, seq, payload)

    def _apply(self, src: EventSource, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload, self._decode)
        except Exception:  # a malformed batch from one replica must not stop the others'
            logger.exception("KV events of %s: batch %d undecodable", src.replica, seq)
            events = []
        self.index.apply(src.replica, events)
        src.last_seq = seq

    def _replay(self, src: EventSource, start: int, upto: int | None = None) -> None:
        """Apply the replica's buffered batches from `start` (up to `upto`, exclusive)."""
        if src.replay_endpoint is None:
            return
        zmq = self._zmq
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(src.replay_endpoint)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while req.poll(5000):
                frames = req.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == -1:
                    return
                if seq > src.last_seq and (upto is None or seq < upto):
                    if seq > src.last_seq + 1 and src.last_seq >= 0:
                        src.num_gaps += 1
                    self._apply(src, seq, frames[-1])
            logger.warning("KV events of %s: no replay answer from %s in 5 s", src.replica, src.replay_endpoint)
        finally:
            req.close(linger=0)
