"""Which replica holds which KV block, kept from the replicas' KV events (the kv-events policy).

Pure Python. Each replica publishes its prefix cache's changes (octavo/kv_events.py, vLLM's
layout); `KVBlockIndex.apply` takes one decoded batch of a replica, and `match` says how many
leading blocks of a prompt a replica holds (in its pool or its second tier). Hashes are kept in
vLLM's integer form (a hash's last 8 bytes, big-endian) whatever form a replica publishes, so
replicas of either `hash_format` meet the router's own hashing.

`PromptHasher` makes a prompt's block hashes the way a replica does under
--prefix-caching-hash-algo sha256_cbor: the router must tokenize exactly as the replicas (the same
model's tokenizer and chat template). A replica whose published tokens do not hash to what it
published (another algorithm, block size or seed) is reported by `KVBlockIndex.disagreeing`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from octavo.kv_cache.events import hash_as_int
from octavo.kv_cache.prefix_cache import extend_block_hashes, root_hash

MAIN_GROUP = 0  # prompts are matched on the first KV group (every layer's, or the global layers')
NUM_CHECKED = 16  # stored blocks per replica whose hash the index recomputes


def wire_int(value: int | bytes) -> int:
    """A published hash in vLLM's integer form."""
    return hash_as_int(value) if isinstance(value, bytes) else int(value)


class PromptHasher:
    """Token ids -> the chained sha256_cbor block hashes a replica computes for them (integer
    form), full blocks only; no extra keys (a request with a cache salt or a LoRA adapter hashes
    otherwise and simply matches nothing)."""

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self._root = root_hash("sha256_cbor")

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        out: list[bytes] = []
        extend_block_hashes(out, token_ids, self.block_size, algo="sha256_cbor", root=self._root)
        return [wire_int(h) for h in out]

    def check(self, parent: int | bytes | None, token_ids: Sequence[int], block_hashes: Sequence[int | bytes]) -> bool | None:
        """Whether a stored event's blocks hash as this hasher would (None: cannot tell: a chain
        that does not start at the root, or no tokens)."""
        if parent is not None or not token_ids or len(token_ids) != len(block_hashes) * self.block_size:
            return None
        return self.hashes(token_ids) == [wire_int(h) for h in block_hashes]


class SentBlocks:
    """Blocks a router sent to each replica in the last `ttl_s` seconds, which count as held until
    the replica's own report says so (its events or stats come only after the prefill: requests
    sharing a new prefix in a burst must meet too). At most `max_blocks` per replica."""

    def __init__(self, ttl_s: float, max_blocks: int = 65536) -> None:
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        self._sent: dict[Any, OrderedDict[int, float]] = {}  # replica -> block hash -> when sent

    def mark(self, replica: Any, blocks: Sequence[int], now: float) -> None:
        sent = self._sent.setdefault(replica, OrderedDict())
        for h in blocks:
            sent[h] = now
            sent.move_to_end(h)
        self._prune(sent, now)

    def prune(self, now: float) -> None:
        """Forget what expired for every replica (sizes compare only when all are pruned)."""
        for sent in self._sent.values():
            self._prune(sent, now)

    def _prune(self, sent: OrderedDict[int, float], now: float) -> None:
        while sent and (len(sent) > self.max_blocks or next(iter(sent.values())) < now - self.ttl_s):
            sent.popitem(last=False)

    def holds(self, replica: Any, block: int, now: float) -> bool:
        when = self._sent.get(replica, {}).get(block)
        return when is not None and when >= now - self.ttl_s

    def match(self, replica: Any, blocks: Sequence[int], now: float) -> int:
        """How many leading blocks of `blocks` were sent to the replica within the TTL."""
        n = 0
        for h in blocks:
            if not self.holds(replica, h, now):
                break
            n += 1
        return n

    def size(self, replica: Any) -> int:
        return len(self._sent.get(replica, ()))

    def forget(self, replica: Any) -> None:
        self._sent.pop(replica, None)


class KVBlockIndex:
    """replica -> {hash: number of media holding it}; thread-safe (listeners write, the router reads)."""

    def __init__(self, hasher: PromptHasher | None = None) -> None:
        self.hasher = hasher or PromptHasher()
        self._held: dict[str, dict[int, int]] = {}
        self._media: dict[str, set[tuple[str, int]]] = {}
        self._checks: dict[str, list[bool]] = {}
        self._lock = threading.Lock()

    def apply(self, replica: str, events: Sequence[Any]) -> None:
        """One batch's events of `replica`, each a dict (map layout) or a list (array layout)."""
        with self._lock:
            held = self._held.setdefault(replica, {})
            media = self._media.setdefault(replica, set())
            for event in events:
                kind, fields = _fields(event)
                if kind == "AllBlocksCleared":
                    held.clear()
                    media.clear()
                    continue
                if fields.get("group_idx") not in (None, MAIN_GROUP):
                    continue
                medium = fields.get("medium") or "GPU"
                if kind == "BlockStored":
                    self._check(replica, fields)
                for value in fields.get("block_hashes") or ():
                    h = wire_int(value)
                    if kind == "BlockStored" and (medium, h) not in media:
                        media.add((medium, h))
                        held[h] = held.get(h, 0) + 1
                    elif kind == "BlockRemoved" and (medium, h) in media:
                        media.discard((medium, h))
                        if held[h] == 1:
                            del held[h]
                        else:
                            held[h] -= 1

    def _check(self, replica: str, fields: dict[str, Any]) -> None:
        checks = self._checks.setdefault(replica, [])
        if len(checks) < NUM_CHECKED:
            ok = self.hasher.check(fields.get("parent_block_hash"), fields.get("token_ids") or (),
                                   fields.get("block_hashes") or ())
            if ok is not None:
                checks.append(ok)

    def forget(self, replica: str) -> None:
        """Drop what is known of a replica (its stream restarts from scratch)."""
        with self._lock:
            self._held.pop(replica, None)
            self._media.pop(replica, None)

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the replica holds in some medium."""
        with self._lock:
            held = self._held.get(replica, {})
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            return n

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return len(self._held.get(replica, {}))

    def disagreeing(self) -> list[str]:
        """Replicas whose checked blocks did not hash as the router does (none of them did)."""
        with self._lock:
            return [r for r, checks in self._checks.items() if checks and not any(checks)]


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of an event in either layout; ("", {}) for one of another shape."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        names = _ARRAY_FIELDS.get(event[0], ())
        return event[0], dict(zip(names, event[1:]))
    return "", {}


def decode_batch(payload: bytes, decode: Callable[[bytes], Any]) -> list[Any]:
    """The events of one published batch ([ts, events, rank], or a map with "events")."""
    batch = decode(payload)
    if isinstance(batch, dict):
        return list(batch.get("events") or ())
    if isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list):
        return batch[1]
    return []
