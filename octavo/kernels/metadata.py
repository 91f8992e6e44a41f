"""AttentionMetadata: where each query token's keys live in the paged KV cache, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKENDS = ("reference", "cpu", "triton")


@dataclass(slots=True)
class PrefillSpan:
    """A request with more than one query token: queries [q_start, q_start + q_len) of the batch,
    at absolute positions [context_len - q_len, context_len); keys are `context_slots`."""

    q_start: int
    q_len: int
    context_len: int
    context_slots: torch.Tensor  # [context_len] long, slot = block_id * block_size + offset


@dataclass(slots=True)
class GatheredContexts:
    """The torch reference kernel's view of a step: every key's slot, for gathering contexts.

    `decode_slots[i, j]` is the slot of key j of decode request i, padded past its context
    length (masked by `decode_mask`). Built once per step and shared by every layer.
    """

    decode_slots: torch.Tensor  # [num_decodes, max_context] long
    decode_mask: torch.Tensor  # [num_decodes, max_context] bool, True where a key exists
    prefills: list[PrefillSpan]
    # Reused scratch of at least num_decodes * max_context * num_kv_heads * head_dim elements each,
    # for the gathered keys and values: fresh tensors of tens of MB per layer would each pay page
    # faults that cost more than the copy itself.
    decode_workspace: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class LoRAMapping:
    """The step's tokens grouped by adapter slot: `groups[k] = (slot, token rows)`; rows of the
    base model appear in no group."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, [num_rows] long)


@dataclass(slots=True)
class PromptRows:
    """The int8 mode's prompt rows of a step (kernels/dispatch.py PROMPT_TILES_MIN_TOKENS): `rows`
    go through the AMX-BF16 tiles, `other` (None: no other rows) through the int8 kernel."""

    rows: torch.Tensor  # [n] long
    other: torch.Tensor | None  # [num_tokens - n] long
    mask: torch.Tensor  # [num_tokens] bool: True at `rows`

    @staticmethod
    def of(mask: torch.Tensor) -> PromptRows | None:
        """From a bool mask over the rows (None where no row is set)."""
        if not bool(mask.any()):
            return None
        other = None if bool(mask.all()) else (~mask).nonzero().squeeze(1)
        return PromptRows(mask.nonzero().squeeze(1), other, mask)

    def select(self, rows: torch.Tensor) -> PromptRows | None:
        """The same choice for a layer that sees only `rows` of the step (a MoE expert's tokens)."""
        return PromptRows.of(self.mask[rows])


@dataclass(slots=True)
class AttentionMetadata:
    """One step's requests as the kernels see them, in batch order: the single-token (decode-like)
    requests first, then the multi-token spans.

    Request s owns query rows [query_starts[s], query_starts[s] + query_lens[s]) at absolute
    positions [context_lens[s] - query_lens[s], context_lens[s]); its keys 0 .. context_lens[s]-1
    are in blocks block_tables[s, 0 ..] (rows padded with block 0 past the request's blocks).
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_starts: torch.Tensor  # [num_seqs] int32
    query_lens: torch.Tensor  # [num_seqs] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    num_decode_tokens: int
    backend: str = "reference"  # which kernels run this step (see kernels/dispatch.py)
    # Host copies of the longest query and context, for launch grids (None: read from the tensors,
    # a device sync); the runner fills them from its Python lists.
    max_query_len: int | None = None
    max_context_len: int | None = None
    allow_split_kv: bool = True  # False inside a captured CUDA graph (one kernel choice per graph)
    lora: LoRAMapping | None = None  # which tokens run with which adapter (None: the base model only)
    prompt_rows: PromptRows | None = None  # int8 layers' rows for the AMX-BF16 tiles (None: none)
    gathered: GatheredContexts | None = None  # the reference kernel's slots, when it runs
    # One metadata per KV group (config.kv_groups; this one is group 0's), when a model's layers
    # page their KV through several block tables (sliding-window groups); None with one group.
    group_metas: list[AttentionMetadata] | None = None


def gather_contexts(
    meta: AttentionMetadata, block_size: int, workspace: tuple[torch.Tensor, torch.Tensor] | None = None
) -> GatheredContexts:
    """Expand the block tables into per-key slots (the reference kernel's input)."""
    device = meta.block_tables.device
    tables = meta.block_tables.long()
    offsets = torch.arange(block_size, device=device)
    nd = meta.num_decode_tokens
    if nd:
        max_len = int(meta.context_lens[:nd].max())
        slots = (tables[:nd, :, None] * block_size + offsets).reshape(nd, -1)[:, :max_len]  # [nd, L]
        mask = torch.arange(max_len, device=device)[None, :] < meta.context_lens[:nd, None]  # [nd, L]
    else:
        slots = torch.zeros((0, 0), dtype=torch.long, device=device)
        mask = slots.bool()
    spans = []
    for s in range(nd, tables.shape[0]):
        context_len = int(meta.context_lens[s])
        context_slots = (tables[s, :, None] * block_size + offsets).reshape(-1)[:context_len]
        spans.append(PrefillSpan(int(meta.query_starts[s]), int(meta.query_lens[s]), context_len, context_slots))
    return GatheredContexts(slots, mask, spans, workspace)
