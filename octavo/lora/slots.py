"""LoRASlots: the adapters a runner knows (their weights on the host) and which of them sit in the
`max_loras` slots of the wrapped projections, swapped least-recently-used first."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from pathlib import Path

from octavo.config import ModelConfig
from octavo.lora.adapter import LoRAAdapter, load_peft_adapter
from octavo.lora.layers import LoRALinear
from octavo.lora.request import LoRARequest

logger = logging.getLogger("octavo")


def adapter_digest(path: str) -> str:
    """The prefix cache's key of an adapter: a sha256 of its config and weights files. The same
    files give the same KV, whatever id names them; other files never share it, in this process
    or (through the second KV tier) after a restart, even when an id is reused."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(Path(path) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()[:32]


class LoRASlots:
    def __init__(self, layers: list[LoRALinear], cfg: ModelConfig, max_loras: int, max_rank: int) -> None:
        self.layers, self.cfg, self.max_loras, self.max_rank = layers, cfg, max_loras, max_rank
        self.adapters: dict[int, LoRAAdapter] = {}
        self.paths: dict[int, str] = {}
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.num_loads = 0  # adapters put in a slot
        self.num_added = 0  # adapters read from disk

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Load the adapter on first sight (ValueError when it cannot be used); later requests with
        the same id reuse it. An id or a name already taken by another adapter is refused."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.name != request.lora_name or self.paths[request.lora_int_id] != request.lora_path:
                raise ValueError(f"LoRA id {request.lora_int_id} is already {known.name!r} at "
                                 f"{self.paths[request.lora_int_id]}; one id names one adapter")
            return known
        if any(a.name == request.lora_name for a in self.adapters.values()):
            raise ValueError(f"a LoRA adapter named {request.lora_name!r} is already loaded with another id")
        adapter = load_peft_adapter(request.lora_path, request.lora_int_id, request.lora_name, self.cfg, self.max_rank)
        self.num_added += 1
        adapter.cache_key = adapter_digest(request.lora_path)
        self.adapters[adapter.lora_id] = adapter
        self.paths[adapter.lora_id] = request.lora_path
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MiB) loaded from %s", adapter.name, adapter.lora_id,
                    adapter.rank, adapter.num_bytes / 2**20, request.lora_path)
        return adapter

    def holds(self, request: LoRARequest) -> bool:
        """Whether exactly this adapter (id, name and path) is loaded now."""
        adapter = self.adapters.get(request.lora_int_id)
        return adapter is not None and adapter.name == request.lora_name and self.paths[adapter.lora_id] == request.lora_path

    def requests(self) -> list[LoRARequest]:
        """The adapters loaded, in id order, as the requests that name them."""
        return [LoRARequest(a.name, i, self.paths[i]) for i, a in sorted(self.adapters.items())]

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (the caller makes sure no request still runs with it)."""
        if lora_id not in self.adapters:
            raise ValueError(f"no LoRA adapter with id {lora_id} is loaded")
        del self.adapters[lora_id]
        del self.paths[lora_id]
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers:
                layer.set_slot(slot, None)

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Put every adapter of this step in a slot (evicting the least recently used ones not in
        the step) -> adapter id -> slot. At most max_loras ids (the scheduler keeps it so)."""
        if len(lora_ids) > self.max_loras:
            raise ValueError(f"a step uses {len(lora_ids)} adapters but there are {self.max_loras} slots")
        for lora_id in lora_ids:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._slot_of if i not in lora_ids)
                slot = self._slot_of.pop(victim)
            for layer in self.layers:
                layer.set_slot(slot, self.adapters[lora_id])
            self._slot_of[lora_id] = slot
            self.num_loads += 1
        return {i: self._slot_of[i] for i in lora_ids}
