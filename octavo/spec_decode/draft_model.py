"""DraftModel: a smaller model of the same tokenizer drafts each candidate request's next tokens
greedily, on a KV cache of its own, before the step that verifies them (speculative decoding's
`--speculative-method draft`: the SpecDecodeController's proposer).

Its cache holds one slot per request it drafts for (a fixed run of blocks covering
max_model_len), least recently used slots reused. Per request it remembers the tokens whose KV the
slot holds; the next time it drafts for that request it keeps the longest prefix those share with
the request's tokens (the drafts the target kept) and computes only the rest, then drafts one
token per forward, all candidates batched. Drafting greedily makes each draft a point mass, so
the runner's verification (sample each position, keep drafts while they agree) is the exact
rejection rule and the output distribution is the target's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from octavo.config import CacheConfig, EngineConfig, ModelConfig
from octavo.model_runner import ModelRunner
from octavo.models.loader import describe_weights, load_model, resolve_model
from octavo.models.layers import CausalLM
from octavo.outputs import SampleRow, ScheduledRequest, SchedulerOutput
from octavo.request import Request
from octavo.sampling.params import SamplingParams

logger = logging.getLogger("octavo")

_GREEDY = SamplingParams(temperature=0.0)


class DraftModel:
    def __init__(self, model: CausalLM, model_config: ModelConfig, target_vocab_size: int, max_model_len: int,
                 num_slots: int, block_size: int, device: str, kv_dtype, attention_backend: str) -> None:
        """`num_slots`: requests whose draft KV is kept at once (the scheduler's max_batch + 1)."""
        if len(model_config.kv_groups()) > 1:
            raise ValueError("a draft model with sliding-window layers is not supported: use one with global attention")
        if model_config.vocab_size != target_vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model_config.vocab_size} tokens) differs from the model's "
                             f"({target_vocab_size}): it must use the same tokenizer")
        self.blocks_per_slot = -(-max_model_len // block_size)
        self.runner = ModelRunner(model, model_config, CacheConfig(block_size=block_size), (), device, kv_dtype,
                                  attention_backend, max_num_seqs=num_slots, max_model_len=max_model_len)
        self.runner.init_kv_cache(num_slots * self.blocks_per_slot)
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()  # request id -> slot, least recently used first
        self._cached: dict[str, list[int]] = {}  # request id -> the tokens whose KV its slot holds

    def _slot(self, request_id: str) -> int:
        if request_id in self._slots:
            self._slots.move_to_end(request_id)
            return self._slots[request_id]
        if len(self._slots) < self.num_slots:
            slot = len(self._slots)
        else:
            old, slot = self._slots.popitem(last=False)
            self._cached.pop(old, None)
        self._slots[request_id] = slot
        self._cached[request_id] = []
        return slot

    def _entry(self, request_id: str, token_ids: list[int], start: int) -> ScheduledRequest:
        slot = self._slots[request_id]
        blocks = list(range(slot * self.blocks_per_slot, (slot + 1) * self.blocks_per_slot))
        return ScheduledRequest(request_id, token_ids, start, [blocks], _GREEDY, [SampleRow(request_id)], [])

    def propose(self, candidates: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """request id -> up to n greedy drafts after its last token, for each (request, n) of
        `candidates` (the first `num_slots` of them). Writes only this model's own cache."""
        if not candidates:
            return {}
        entries = []
        for request, _ in candidates[: self.num_slots]:
            rid, tokens = request.request_id, request.all_token_ids
            self._slot(rid)
            cached = self._cached[rid]
            keep = 0
            while keep < min(len(cached), len(tokens) - 1) and cached[keep] == tokens[keep]:
                keep += 1  # the prefix its slot still holds (the last token is always computed)
            entries.append(self._entry(rid, tokens[keep:], keep))
            self._cached[rid] = list(tokens)
        limits = {request.request_id: n for request, n in candidates[: self.num_slots]}
        drafts: dict[str, list[int]] = {rid: [] for rid in limits}
        while entries:
            sampled = self.runner.execute(SchedulerOutput(entries)).tokens  # one greedy token each
            entries = []
            for rid, (token,) in sampled.items():
                drafts[rid].append(token)
                if len(drafts[rid]) < limits[rid]:  # its KV is computed next, with the one after it
                    entries.append(self._entry(rid, [token], len(self._cached[rid])))
                    self._cached[rid].append(token)
        return drafts

    def finish(self, request: Request) -> None:
        """A request that ended: its slot becomes free for others."""
        if request.request_id in self._slots:
            self._cached[request.request_id] = []


def load_draft_model(config: EngineConfig, attention_backend: str) -> DraftModel:
    """The speculative draft model of config's SpeculativeConfig: loaded as --model would be
    (quantized blocks kept on the CPU), float32 or the engine's dtype, its own KV cache of
    max_batch + 1 request slots."""
    spec = config.scheduler.speculative
    draft_dir = resolve_model(spec.draft_model)
    quantization = "none" if config.device.startswith("cuda") else "auto"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
    model, model_config = load_model(draft_dir, dtype=dtype, device=config.device, quantization=quantization,
                                     activation_dtype=config.activation_dtype)
    logger.info("draft model %s: %s", draft_dir.name, describe_weights(model))
    return DraftModel(model, model_config, config.model_config.vocab_size, config.scheduler.max_model_len,
                      spec.max_batch + 1, config.cache.block_size, config.device, dtype, attention_backend)
