"""Sampler: last-position logits -> one token per sequence, with penalties, truncation and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.sampling.logprobs import TokenLogprob
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


def apply_token_bitmask(logits: torch.Tensor, row_index: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs: logits [n, vocab]; rows `row_index` [k] keep only the tokens whose bit is
    set in their bitmask row [k, ceil(vocab / 32)] int32 (bit t % 32 of word t // 32); the others
    become -inf. All k rows in one masked_fill, returning a new tensor (xgrammar's
    apply_token_bitmask_inplace computes the same; tests compare them)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [k, vocab]
    out = logits.clone()
    out[row_index] = logits[row_index].masked_fill(~allowed, float("-inf"))
    return out


def _flat_ids(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every entry of per-row token lists, as two long tensors."""
    rows = [r for r, ids in enumerate(lists) for _ in ids]
    ids = [t for ids in lists for t in ids]
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(ids, dtype=torch.long, device=device)


def apply_penalties_batched(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """apply_penalties on every row at once: logits [n, vocab] (rows without penalties unchanged)
    -> a new tensor. Token lists become index tensors; no per-row kernel launches."""
    n, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    out = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        # only the seen entries change: gather them, penalise, scatter back (no [n, vocab] passes)
        seen = [sorted(set(r.prompt_token_ids) | set(r.output_token_ids)) if r.params.repetition_penalty != 1.0 else []
                for r in rows]
        r_idx, t_idx = _flat_ids(seen, device)
        rp = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[r_idx]
        vals = out[r_idx, t_idx]
        out = out.clone()
        out[r_idx, t_idx] = torch.where(vals > 0, vals / rp, vals * rp)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        counts = torch.zeros((n, vocab), dtype=logits.dtype, device=device)
        r_idx, t_idx = _flat_ids([r.output_token_ids for r in rows], device)
        counts.index_put_((r_idx, t_idx), torch.ones_like(r_idx, dtype=logits.dtype), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
        out = out - (freq * counts + pres * (counts > 0).to(logits.dtype))
    return out


def truncate_batched(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """truncate on every row at once: per-row temperature, top-k, top-p and min-p -> a new tensor
    [n, vocab] with masked entries -inf. Rows that do not ask for a filter are left alone by it."""
    n, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, dtype=torch.long, device=device)
        values = torch.topk(logits, max(top_k), dim=-1).values  # [n, max_k], descending
        kth = values.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=logits.dtype, device=device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def _unban_eos_where_nothing_is_left(logits: torch.Tensor, rows: list[SamplingRow], grammar_rows: torch.Tensor) -> torch.Tensor:
    """A grammar row whose grammar allows only tokens that min_tokens bans (it is complete, and only
    EOS may follow) has no token left: it gets its EOS back, so the grammar wins over min_tokens.
    Without this the draw would pick token 0. In place on the (already copied) logits."""
    dead = torch.isneginf(logits[grammar_rows]).all(dim=-1)
    for i in grammar_rows[dead].tolist():
        logits[i, list(rows[i].eos_token_ids)] = 0.0
    return logits


def _apply_bias_and_allowed(logits: torch.Tensor, rows: list[SamplingRow], edited: bool) -> torch.Tensor:
    """OpenAI's logit_bias (added to the logits, all rows at once) and vLLM's allowed_token_ids
    (every other token banned); a copy when anything changes and `edited` is False (the caller's
    logits stay as they were)."""
    device = logits.device
    if any(r.params.logit_bias for r in rows):
        logits = logits if edited else logits.clone()
        edited = True
        r_idx, t_idx = _flat_ids([[t for t, _ in r.params.logit_bias] for r in rows], device)
        bias = torch.tensor([v for r in rows for _, v in r.params.logit_bias], dtype=logits.dtype, device=device)
        logits.index_put_((r_idx, t_idx), bias, accumulate=True)
    if any(r.params.allowed_token_ids for r in rows):
        logits = logits if edited else logits.clone()
        for i, r in enumerate(rows):
            if r.params.allowed_token_ids:
                ids = torch.tensor(r.params.allowed_token_ids, dtype=torch.long, device=device)
                kept = logits[i, ids].clone()
                logits[i] = float("-inf")
                logits[i, ids] = kept
    return logits


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    generator_states: dict[int, object] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] float32 -> a token per row and, where asked, its logprobs.

    Every transformation runs on all rows at once (penalties, min_tokens bans, temperature,
    top-k/top-p/min-p, the draw), so a GPU step launches the same few kernels whatever the batch;
    the only per-row work is a seeded row's own noise draw. Logprobs are those of the model's raw
    distribution (before penalties and temperature). Random rows draw with their own generator
    when seeded, so a seeded request samples the same tokens whatever else is in the batch.
    `allowed` = (row index [k], token bitmask [k, words]) restricts those rows to their grammar's
    tokens first (structured outputs), so their logprobs are of the allowed tokens too.
    `generator_states`: for each of its keys (a row index) that draws with its own generator,
    set to that generator's state right after the row's draw (speculative decoding rewinds a
    sequence's generator to its last kept token, so seeded output does not depend on drafts).
    """
    num_rows = logits.shape[0]
    device = logits.device
    if allowed is not None:
        logits = apply_token_bitmask(logits, allowed[0], allowed[1])
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    )
    edited = any(r.params.has_penalties for r in rows)
    if edited:
        logits = apply_penalties_batched(logits, rows)  # a new tensor: the caller's stays as it was
    bans = [
        list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(r.eos_token_ids))
        if len(r.output_token_ids) < r.params.min_tokens else []
        for r in rows
    ]
    if any(bans):
        logits = logits if edited else logits.clone()
        edited = True
        logits[_flat_ids(bans, device)] = float("-inf")
        if allowed is not None:
            logits = _unban_eos_where_nothing_is_left(logits, rows, allowed[0])
    logits = _apply_bias_and_allowed(logits, rows, edited)

    tokens = logits.argmax(dim=-1)  # greedy rows are done; random rows are redrawn below
    random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, dtype=torch.long, device=device)
        probs = torch.softmax(truncate_batched(logits[index], [rows[i].params for i in random_rows]), dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Unseeded rows share one
        # draw; a seeded row redraws its own row from its generator.
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            if rows[i].generator is not None:
                noise[j].exponential_(generator=rows[i].generator)
                if generator_states is not None and i in generator_states:
                    generator_states[i] = rows[i].generator.get_state()
        tokens[index] = torch.argmax(probs / noise, dim=-1)
    token_list = tokens.tolist()

    logprobs: list[TokenLogprob | None] = [None] * num_rows
    if raw_logprobs is not None:
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        index = torch.tensor(asked, dtype=torch.long, device=device)
        chosen = raw_logprobs[index, tokens[index]].tolist()
        k_max = max(rows[i].params.logprobs for i in asked)
        top = torch.topk(raw_logprobs[index], k_max, dim=-1) if k_max > 0 else None
        top_ids = top.indices.tolist() if top is not None else None
        top_values = top.values.tolist() if top is not None else None
        for j, i in enumerate(asked):
            k = rows[i].params.logprobs
            named = rows[i].params.logprob_token_ids
            if named:  # vLLM's logprob_token_ids: these tokens' logprobs (and the sampled one's), not the top k
                values = raw_logprobs[i, list(named)].tolist()
                top = {t: v for t, v in zip(named, values)} | {token_list[i]: chosen[j]}
            else:
                # a grammar's masked tokens (-inf) are not alternatives: fewer than k entries then
                top = {t: v for t, v in zip(top_ids[j][:k], top_values[j][:k]) if v != float("-inf")} if k > 0 else {}
            logprobs[i] = TokenLogprob(token_id=token_list[i], logprob=chosen[j], top=top)
    return token_list, logprobs
