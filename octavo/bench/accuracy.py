"""`octavo eval`: what a computation mode costs in accuracy against the exact float32 path on the
same weights (int8 activations, --activation-dtype int8; a KV cache in fewer bytes,
--kv-cache-dtype; or both): over a fixed text, per token the KL
divergence of the mode's next-token distribution from the exact one and whether both put the same
token first, and each mode's perplexity.

The text is cut into windows of `ctx` tokens as llama.cpp's `llama-perplexity` cuts it: each
window computed from scratch, its first token replaced by BOS where the tokenizer starts a text
with one, and only positions ctx / 2 .. ctx - 2 scored (each predicting the next token, with at
least ctx / 2 tokens before it). So its perplexity on the same text, file and ctx is the figure to
set beside these (tools/compare_llama_cpp.sh PERPLEXITY=1 prints both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.config import ACTIVATION_DTYPES, KV_CACHE_DTYPES, CacheConfig, ModelConfig
from octavo.model_runner import ModelRunner
from octavo.models.layers import CausalLM
from octavo.outputs import ScheduledRequest
from octavo.sampling.params import SamplingParams

DEFAULT_TEXT = Path(__file__).parent / "data" / "eval_text.txt"
LOGIT_ROWS = 128  # positions whose [rows, vocab] logits are held at once per mode


@dataclass(frozen=True, slots=True)
class ModeScore:
    mode: str
    perplexity: float
    mean_kl: float  # nats per token, against the exact path (0 for the exact path itself)
    max_kl: float
    same_top_token: float  # share of scored tokens whose most likely next token is the exact path's


@dataclass(frozen=True, slots=True)
class EvalResult:
    num_tokens: int  # scored
    ctx: int
    scores: list[ModeScore]


def parse_mode(mode: str) -> tuple[str, str]:
    """An `octavo eval` mode -> (activation dtype, KV dtype): "int8" (int8 activations), "kv-int8"
    (float32 activations, an int8 KV cache), "int8+kv-bfloat16" (both); "float32" is the exact path."""
    activation, kv = "float32", "float32"
    for part in mode.split("+"):
        if part.startswith("kv-") and part[3:] in KV_CACHE_DTYPES:
            kv = part[3:]
        elif part in ACTIVATION_DTYPES:
            activation = part
        else:
            raise ValueError(f"unknown mode {mode!r}: an activation dtype ({', '.join(ACTIVATION_DTYPES)}), a KV dtype "
                             f"({', '.join('kv-' + k for k in KV_CACHE_DTYPES)}), or both joined by '+'")
    return activation, kv


def windows(token_ids: list[int], ctx: int, max_windows: int | None = None, bos: int | None = None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens (the last partial one dropped), at most `max_windows`;
    with `bos`, each window's first token replaced by it."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens, got {ctx}")
    out = [token_ids[i : i + ctx] for i in range(0, len(token_ids) - ctx + 1, ctx)]
    if bos is not None:
        out = [[bos, *w[1:]] for w in out]
    if not out:
        raise ValueError(f"the text has {len(token_ids)} tokens: fewer than one window of {ctx}")
    return out[:max_windows] if max_windows else out


class Scorer:
    """One model behind a runner of its own, one window at a time, for its hidden states."""

    def __init__(self, model: CausalLM, model_config: ModelConfig, ctx: int, attention_backend: str = "auto",
                 kv_dtype: torch.dtype = torch.float32) -> None:
        self.model, self.block_size = model, 16
        self.num_groups = len(model_config.kv_groups())
        self.num_blocks = -(-ctx // self.block_size)
        self.runner = ModelRunner(model, model_config, CacheConfig(block_size=self.block_size), (),
                                  kv_dtype=kv_dtype, attention_backend=attention_backend, max_num_seqs=1,
                                  max_model_len=ctx, dtype=torch.float32)
        self.runner.init_kv_cache(self.num_blocks)

    @torch.inference_mode()
    def hidden(self, tokens: list[int]) -> torch.Tensor:
        """The last layer's hidden states of `tokens` computed from scratch: [len(tokens), hidden]."""
        blocks = list(range(self.num_blocks))
        entry = ScheduledRequest("eval", tokens, 0, [blocks] * self.num_groups, SamplingParams(), [], tokens)
        ids, positions, meta = self.runner.prepare([entry])
        return self.model(ids, positions, self.runner.kv_caches, meta)

    @torch.inference_mode()
    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.model.compute_logits(hidden), dim=-1)


def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """(the text's token ids, the BOS id each window starts with: None where the tokenizer adds none)."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids, bos if bos is not None and ids and ids[0] == bos else None


def evaluate(scorers: dict[str, Scorer], token_ids: list[int], ctx: int, exact: str = "float32",
             max_windows: int | None = None, progress=None, bos: int | None = None) -> EvalResult:
    """Score every mode of `scorers` (name -> Scorer; `exact` names the reference) over the text."""
    nll = {m: 0.0 for m in scorers}
    kl_sum = {m: 0.0 for m in scorers}
    kl_max = {m: 0.0 for m in scorers}
    same = {m: 0 for m in scorers}
    count = 0
    for window in windows(token_ids, ctx, max_windows, bos):
        hidden = {m: s.hidden(window) for m, s in scorers.items()}
        first = ctx // 2  # position p predicts token p + 1; score p in [ctx / 2, ctx - 1)
        for lo in range(first, ctx - 1, LOGIT_ROWS):
            hi = min(ctx - 1, lo + LOGIT_ROWS)
            targets = torch.tensor(window[lo + 1 : hi + 1], dtype=torch.long)
            ref = scorers[exact].logprobs(hidden[exact][lo:hi])
            ref_top = ref.argmax(-1)
            for m, s in scorers.items():
                lp = ref if m == exact else s.logprobs(hidden[m][lo:hi])
                nll[m] -= float(lp.gather(1, targets[:, None]).sum())
                kl = (ref.exp() * (ref - lp)).sum(-1)  # [rows]
                kl_sum[m] += float(kl.sum())
                kl_max[m] = max(kl_max[m], float(kl.max()))
                same[m] += int((lp.argmax(-1) == ref_top).sum())
            count += hi - lo
        if progress is not None:
            progress.update(1)
    scores = [ModeScore(m, math.exp(nll[m] / count), kl_sum[m] / count, kl_max[m], same[m] / count) for m in scorers]
    return EvalResult(count, ctx, scores)


KL_BASE_MAGIC = b"_logits_"


def kl_base_row(logits: torch.Tensor) -> torch.Tensor:
    """One position's next-token log-probabilities as llama-perplexity stores them for
    `--kl-divergence-base` (tools/perplexity/perplexity.cpp, `log_softmax`): two float32 (the step,
    the least log-probability kept, floored at 16 nats under the top logit) as four uint16, then one
    uint16 per vocabulary entry ((logit - floor) / step, rounded; 0 at or under the floor), padded
    to an even count. Returns the row as int32 values 0..65535 (written as uint16)."""
    logits = logits.float()
    top, low = float(logits.max()), float(logits.min())
    low = max(low, top - 16)
    log_sum_exp = math.log(float(torch.exp((logits - top).double()).sum()))
    step = (top - low) / 65535
    head = torch.tensor([step, low - top - log_sum_exp], dtype=torch.float32).view(torch.int16).to(torch.int32) & 0xFFFF
    n = logits.numel()
    q = torch.zeros(2 * ((n + 1) // 2), dtype=torch.int32)
    if step:
        q[:n] = torch.where(logits > low, torch.round((logits - low) * (1 / step)), 0).to(torch.int32)
    return torch.cat([head, q])


def write_kl_base(path: str | Path, scorer: Scorer, token_ids: list[int], ctx: int, max_windows: int | None = None,
                  bos: int | None = None) -> int:
    """llama-perplexity's log-probability file (`--kl-divergence-base`) of `scorer`'s model over the
    text, cut as `evaluate` cuts it: "_logits_", ctx (u32), vocabulary size and window count (i32),
    the windows' tokens as the text has them (i32; llama.cpp puts BOS first itself), then per window
    the rows `kl_base_row` of positions ctx / 2 .. ctx - 2. `llama-perplexity -m FILE.gguf
    --kl-divergence-base PATH --kl-divergence -c CTX` then scores llama.cpp's own logits against
    these (mean KL divergence, same top token). Returns the number of windows written."""
    import numpy as np

    cut = windows(token_ids, ctx, max_windows)
    with open(path, "wb") as out, torch.inference_mode():
        out.write(KL_BASE_MAGIC)
        vocab = None
        for w, window in enumerate(cut):
            hidden = scorer.hidden(window if bos is None else [bos, *window[1:]])
            logits = scorer.model.compute_logits(hidden[ctx // 2 : ctx - 1])
            if vocab is None:
                vocab = logits.shape[-1]
                out.write(np.array([ctx], "<u4").tobytes() + np.array([vocab, len(cut)], "<i4").tobytes())
                out.write(np.array([t for win in cut for t in win], "<i4").tobytes())
            rows = torch.stack([kl_base_row(row) for row in logits])
            out.write(rows.numpy().astype("<u2").tobytes())
    return len(cut)


def format_table(result: EvalResult) -> str:
    lines = [f"{result.num_tokens} tokens scored (windows of {result.ctx}, positions {result.ctx // 2}..{result.ctx - 2})",
             f"{'mode':<10} {'perplexity':>11} {'mean KL':>10} {'max KL':>9} {'same top':>9}"]
    for s in result.scores:
        lines.append(f"{s.mode:<10} {s.perplexity:>11.4f} {s.mean_kl:>10.5f} {s.max_kl:>9.4f} {s.same_top_token:>9.2%}")
    return "\n".join(lines)
