"""Sampler: last-position logits -> one token per sequence, with penalties, truncation and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.request import TokenLogprob
from octavo.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about the sequence behind one logits row (read-only lists)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row [vocab]. Repetition (prompt and output tokens): positive logits divided,
    negative multiplied. Frequency: minus penalty x count in the output. Presence: minus penalty once."""
    p = row.params
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), device=device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_token_ids:
        counts = torch.bincount(
            torch.tensor(row.output_token_ids, device=device), minlength=logits.shape[-1]
        )[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row [vocab]; masked entries become -inf."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] float32 -> a token per row and, where asked, its logprobs.

    Logprobs are those of the model's raw distribution (before penalties and temperature).
    Random rows draw with their own generator when seeded, so a seeded request samples the same
    tokens whatever else is in the batch.
    """
    num_rows = logits.shape[0]
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    )
    needs_edit = any(
        r.params.has_penalties or len(r.output_token_ids) < r.params.min_tokens for r in rows
    )
    if needs_edit:
        logits = logits.clone()
    for i, row in enumerate(rows):
        if row.params.has_penalties:
            apply_penalties(logits[i], row)
        if len(row.output_token_ids) < row.params.min_tokens:
            banned = list(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                banned += list(row.eos_token_ids)
            if banned:
                logits[i, banned] = float("-inf")

    tokens = logits.argmax(dim=-1).tolist()  # greedy rows are done; random rows are redrawn below
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            continue
        probs = torch.softmax(truncate(logits[i], row.params), dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one generator call per row.
        noise = torch.empty_like(probs).exponential_(generator=row.generator)
        tokens[i] = int(torch.argmax(probs / noise))

    logprobs: list[TokenLogprob | None] = [None] * num_rows
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                continue
            top = torch.topk(raw_logprobs[i], k) if k > 0 else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(raw_logprobs[i, tokens[i]]),
                top=dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {},
            )
    return tokens, logprobs
