"""AttentionMetadata: where each query token's keys live in the paged KV cache, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """A request with more than one query token: queries [q_start, q_start + q_len) of the batch,
    at absolute positions [context_len - q_len, context_len); keys are `context_slots`."""

    q_start: int
    q_len: int
    context_len: int
    context_slots: torch.Tensor  # [context_len] long, slot = block_id * block_size + offset


@dataclass(slots=True)
class AttentionMetadata:
    """Token order in the batch: the decode-like requests (one query token each) first, then spans.

    `decode_slots[i, j]` is the slot of key j of decode request i, padded past
    `decode_context_lens[i]` (masked by `decode_mask`). It is shared by every layer of the step.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    num_decode_tokens: int
    decode_slots: torch.Tensor  # [num_decodes, max_context] long
    decode_mask: torch.Tensor  # [num_decodes, max_context] bool, True where a key exists
    prefills: list[PrefillSpan]
    # Reused scratch of at least num_decodes * max_context * num_kv_heads * head_dim elements each,
    # for the gathered keys and values: fresh tensors of tens of MB per layer would each pay page
    # faults that cost more than the copy itself.
    decode_workspace: tuple[torch.Tensor, torch.Tensor] | None = None
