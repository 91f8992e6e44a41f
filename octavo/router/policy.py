"""Routing policies over replicas, in pure Python: round-robin, least-load, cache-aware, kv-events.

Cache-aware follows the SGLang router's idea: per replica, an approximate tree of the prompts sent
to it; a request goes to the replica whose tree shares the longest prefix with its prompt, unless
the replicas' loads are too uneven, in which case the least-loaded one takes it. The tree here is a
chain of hashes of fixed-size text chunks (a path in a tree of chunks, as block hashes are for the
KV cache), bounded per replica with least-recently-used eviction.

kv-events decides the same way on what the replicas report they hold instead of what they were
sent: the prompt's token blocks (router/kv_index.py) matched against each replica's published
blocks, so prompts that share tokens but not text (a chat request and the same conversation
rendered by the client) meet, and blocks a replica evicted stop attracting requests.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from octavo.router.kv_index import KVBlockIndex, SentBlocks

CHUNK_CHARS = 64  # text per tree node: about 16 tokens, one KV block of the replicas
POLICIES = ("cache-aware", "round-robin", "least-load", "kv-events")
MAX_CACHE_KEYS = 65536  # prompt_cache_key values remembered (least recently used forgotten first)
SENT_TTL_S = 30.0  # kv-events: how long blocks sent to a replica count as held before its events say so (default)


def chunk_hashes(text: str) -> list[bytes]:
    """Chained hashes of the full CHUNK_CHARS-character chunks of `text` (a path from the root)."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start : start + CHUNK_CHARS].encode(), digest_size=16).digest()
        out.append(parent)
    return out


@dataclass(slots=True)
class PrefixTree:
    """The chunk paths a replica was sent, at most `max_nodes` of them (LRU)."""

    max_nodes: int = 200_000
    nodes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def match(self, path: list[bytes]) -> int:
        """How many leading chunks of `path` the tree holds."""
        n = 0
        for h in path:
            if h not in self.nodes:
                break
            n += 1
        return n

    def insert(self, path: list[bytes]) -> None:
        for h in path:
            self.nodes[h] = None
            self.nodes.move_to_end(h)
        while len(self.nodes) > self.max_nodes:
            self.nodes.popitem(last=False)


@dataclass(slots=True)
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    tree: PrefixTree = field(default_factory=PrefixTree)


@dataclass(slots=True)
class Choice:
    replica: Replica
    matched_chars: int  # prefix the chosen replica was already sent (cache-aware; else 0)
    matched_blocks: int = 0  # leading blocks the chosen replica reports holding (kv-events)


class Router:
    """Chooses a replica for each request. `cache_threshold`: the share of the prompt that must
    match for the match to decide; `balance_abs` / `balance_rel`: loads are uneven when
    max - min > balance_abs and max > balance_rel * min (SGLang's defaults: 32 and 1.0001)."""

    def __init__(self, urls: list[str], policy: str = "cache-aware", cache_threshold: float = 0.5,
                 balance_abs: int = 32, balance_rel: float = 1.0001, kv_index: KVBlockIndex | None = None,
                 sent_ttl_s: float = SENT_TTL_S) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if (policy == "kv-events") != (kv_index is not None):
            raise ValueError("the kv-events policy needs the replicas' KV block index, and only it uses one")
        self.kv_index = kv_index
        self._sent = SentBlocks(sent_ttl_s)  # kv-events: blocks sent, by replica URL
        if not urls:
            raise ValueError("at least one replica (--worker URL) is needed")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.policy = policy
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self._turn = itertools.count()
        # prompt_cache_key -> the replica its requests went to, least recently used first (bounded)
        self._keys: OrderedDict[str, str] = OrderedDict()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def choose(self, text: str, exclude: set[str] = frozenset(), key: str | None = None,
               blocks: list[int] | None = None) -> Choice | None:
        """A replica for a prompt whose text is `text` (None when no healthy one is left). Inserts
        the prompt into the chosen replica's tree (cache-aware). `key` (OpenAI's prompt_cache_key):
        cache-aware sends requests of one key to one replica while it is healthy and loads are even,
        whatever their text (the client says they share a prefix). `blocks` (kv-events): the
        prompt's block hashes (PromptHasher)."""
        live = [r for r in self.healthy() if r.url not in exclude]
        if not live:
            return None
        if self.policy == "kv-events":
            return self._choose_by_blocks(blocks or [], live)
        if key is not None and self.policy == "cache-aware":
            choice = self._choose_by_key(text, key, live)
            self._keys[key] = choice.replica.url
            self._keys.move_to_end(key)
            if len(self._keys) > MAX_CACHE_KEYS:
                self._keys.popitem(last=False)
            return choice
        return self._choose(text, live)

    def _choose_by_key(self, text: str, key: str, live: list[Replica]) -> Choice:
        url = self._keys.get(key)
        replica = next((r for r in live if r.url == url), None)
        if replica is None or self._is_uneven(live) and replica.in_flight == max(r.in_flight for r in live):
            return self._choose(text, live)
        path = chunk_hashes(text)
        hit = replica.tree.match(path)
        replica.tree.insert(path)
        return Choice(replica, hit * CHUNK_CHARS)

    def _choose_by_blocks(self, blocks: list[int], live: list[Replica]) -> Choice:
        """cache-aware's rule on the blocks the replicas report holding, or were sent within
        `sent_ttl_s` (their events come only once the prefill has run: requests sharing a new
        prefix in a burst must meet too); with no match worth it, the idlest replica, of equals the
        one holding and being sent the fewest blocks (a burst of new prefixes spreads out before
        any event is back)."""
        index, now, sent = self.kv_index, time.monotonic(), self._sent
        sent.prune(now)
        matched = {r.url: max(index.match(r.url, blocks), sent.match(r.url, blocks, now)) for r in live}
        best = max(live, key=lambda r: (matched[r.url], -r.in_flight))
        if self._is_uneven(live):
            chosen = min(live, key=lambda r: r.in_flight)
        elif blocks and matched[best.url] / len(blocks) >= self.cache_threshold:
            chosen = best
        else:  # held nowhere: the idlest replica; of equals, the one holding and being sent the fewest blocks
            chosen = min(live, key=lambda r: (r.in_flight, index.num_blocks(r.url) + sent.size(r.url)))
        sent.mark(chosen.url, blocks, now)
        return Choice(chosen, 0, matched[chosen.url])

    def _is_uneven(self, live: list[Replica]) -> bool:
        loads = [r.in_flight for r in live]
        return max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads)

    def _choose(self, text: str, live: list[Replica]) -> Choice:
        if self.policy == "round-robin":
            return Choice(live[next(self._turn) % len(live)], 0)
        least = min(live, key=lambda r: r.in_flight)
        if self.policy == "least-load":
            return Choice(least, 0)
        path = chunk_hashes(text)
        uneven = self._is_uneven(live)
        best = max(live, key=lambda r: (r.tree.match(path), -r.in_flight))
        matched = best.tree.match(path)
        if uneven:
            chosen = least
        elif path and matched / len(path) >= self.cache_threshold:
            chosen = best
        else:  # little to reuse anywhere: the replica holding the least, to spread prefixes out
            chosen = min(live, key=lambda r: (len(r.tree.nodes), r.in_flight))
        hit = chosen.tree.match(path)
        chosen.tree.insert(path)
        return Choice(chosen, hit * CHUNK_CHARS)
