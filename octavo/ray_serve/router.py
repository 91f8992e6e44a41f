"""A Ray Serve request router that follows the replicas' KV blocks (Ray's request-router API).

Each replica reports, every `request_routing_stats_period_s`, the hashes of the blocks its pool
and second tier hold (`OctavoReplica.record_routing_stats`: sha256_cbor, integer form, the main
KV group). For a request, this router makes its prompt's block hashes as the replicas do (the
model's tokenizer and chat template, router/kv_index.PromptHasher) and ranks the replicas: those
holding the longest prefix of them first, when it is at least `match_threshold` of the prompt,
then the rest. Ray then takes, rank by rank, the replica with the shortest queue that has room
(`max_ongoing_requests`), so a full replica sends the request on rather than queueing it. Blocks
a request was routed with count as held by that replica for `sent_ttl_s` (its report comes only
after the prefill), so a burst sharing a new prefix stays together.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from octavo.router.app import prompt_token_ids
from octavo.router.kv_index import PromptHasher, SentBlocks

logger = logging.getLogger("octavo.ray_serve")


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, model: str | None = None, block_size: int = 16, match_threshold: float = 0.5,
                         sent_ttl_s: float = 30.0) -> None:
        from octavo.models.loader import resolve_model
        from octavo.tokenizer import load_tokenizer

        self._tokenizer = load_tokenizer(resolve_model(model))
        self._hasher = PromptHasher(block_size)
        self._threshold = match_threshold
        self._sent = SentBlocks(sent_ttl_s)
        self._held: dict[ReplicaID, tuple[int, set[int]]] = {}  # replica -> (id of its stats list, the set)
        self.num_matched = 0  # requests sent where most of their prompt was held (for tests and logs)

    def _blocks(self, pending: PendingRequest | None) -> list[int]:
        """The prompt's block hashes (args of OctavoReplica.handle: method, path, body, parsed JSON)."""
        if pending is None or len(pending.args) < 4 or not isinstance(pending.args[3], dict):
            return []
        cached = getattr(pending, "_octavo_blocks", None)
        if cached is None:
            cached = self._hasher.hashes(prompt_token_ids(pending.args[3], self._tokenizer))
            pending._octavo_blocks = cached
        return cached

    def _held_blocks(self, replica: RunningReplica) -> set[int]:
        blocks = (replica.routing_stats or {}).get("blocks") or []
        known = self._held.get(replica.replica_id)
        if known is None or known[0] != id(blocks):
            known = (id(blocks), set(blocks))
            self._held[replica.replica_id] = known
        return known[1]

    def _match(self, replica: RunningReplica, blocks: list[int], now: float) -> int:
        held, rid = self._held_blocks(replica), replica.replica_id
        n = 0
        for h in blocks:
            if h not in held and not self._sent.holds(rid, h, now):
                break
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        blocks = self._blocks(pending_request)
        if not blocks or len(candidate_replicas) < 2:
            return [candidate_replicas]
        now = time.monotonic()
        self._sent.prune(now)
        matched = {r.replica_id: self._match(r, blocks, now) for r in candidate_replicas}
        best = max(matched.values())
        if best / len(blocks) < self._threshold:  # held nowhere: the replicas holding the least first
            size = {r.replica_id: len(self._held_blocks(r)) + self._sent.size(r.replica_id) for r in candidate_replicas}
            ordered = sorted(candidate_replicas, key=lambda r: size[r.replica_id])
            ranks = [ordered[: max(1, len(ordered) // 2)], ordered[max(1, len(ordered) // 2):]]
        else:
            self.num_matched += 1
            first = [r for r in candidate_replicas if matched[r.replica_id] == best]
            rest = [r for r in candidate_replicas if matched[r.replica_id] != best]
            ranks = [first, rest] if rest else [first]
        # Ray routes several requests at once: mark the likely replica now, so a request with the
        # same new prefix routed before this one lands is sent there too (on_request_routed corrects it)
        self._sent.mark(ranks[0][0].replica_id, blocks, now)
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        blocks = self._blocks(pending_request)
        if blocks:
            self._sent.mark(replica_id, blocks, time.monotonic())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.forget(replica_id)
        self._held.pop(replica_id, None)
