"""The exact path's log-probabilities in llama-perplexity's `--kl-divergence-base` format
(`octavo eval --kl-base`), read back here by the layout llama.cpp's perplexity.cpp reads: header,
tokens, one row per scored position whose decoded log-probabilities are the model's to within
half a quantization step."""

from __future__ import annotations

import numpy as np
import torch

from octavo.bench.accuracy import DEFAULT_TEXT, Scorer, kl_base_row, text_tokens, windows, write_kl_base


def _read(path):
    data = open(path, "rb").read()
    assert data[:8] == b"_logits_"
    (ctx,) = np.frombuffer(data, "<u4", 1, 8)
    vocab, chunks = np.frombuffer(data, "<i4", 2, 12)
    tokens = np.frombuffer(data, "<i4", ctx * chunks, 20)
    nv = 2 * ((vocab + 1) // 2) + 4
    rows = np.frombuffer(data, "<u2", offset=20 + 4 * ctx * chunks).reshape(chunks, ctx - 1 - ctx // 2, nv)
    return int(ctx), int(vocab), tokens.reshape(chunks, ctx).tolist(), rows


def _decode(row: np.ndarray, vocab: int) -> np.ndarray:
    """llama.cpp's reading: step and floor from the first four uint16, then floor + step x q."""
    step, floor = row[:4].copy().view("<f4")
    return floor + step * row[4 : 4 + vocab].astype(np.float64), float(step), float(floor)


def test_a_row_keeps_16_nats_under_the_top_and_normalises():
    logits = torch.tensor([3.0, -20.0, 1.5, 3.0, -1.0])
    q = kl_base_row(logits).numpy().astype("<u2")
    lp, step, floor = _decode(q, 5)
    exact = torch.log_softmax(logits.double(), -1).numpy()
    assert step == np.float32((3.0 - (3.0 - 16)) / 65535)
    lse = float(torch.logsumexp(logits.double(), -1))
    assert abs(floor - (3.0 - 16 - lse)) < 1e-5  # the floor: 16 nats under the top logit, not the -20 logit's
    kept = logits.numpy() > 3.0 - 16
    assert np.abs(lp[kept] - exact[kept]).max() <= step / 2 + 1e-6
    assert q[4 + 1] == 0 and len(q) == 4 + 6  # under the floor: 0; padded to an even count


def test_the_file_holds_the_windows_and_the_exact_log_probabilities(smol, tmp_path):
    model, tokenizer, _ = smol
    ctx = 64
    token_ids, bos = text_tokens(tokenizer, DEFAULT_TEXT.read_text())
    scorer = Scorer(model, model.config, ctx)
    assert write_kl_base(tmp_path / "base.kld", scorer, token_ids, ctx, max_windows=2, bos=bos) == 2
    n_ctx, vocab, tokens, rows = _read(tmp_path / "base.kld")
    assert (n_ctx, vocab) == (ctx, model.config.vocab_size)
    assert tokens == windows(token_ids, ctx, 2)  # as the text has them: llama.cpp puts BOS first itself
    for w, window in enumerate(tokens):
        exact = scorer.logprobs(scorer.hidden([bos, *window[1:]] if bos is not None else window))
        for p in (ctx // 2, ctx - 2):
            lp, step, floor = _decode(rows[w, p - ctx // 2], vocab)
            ref = exact[p].double().numpy()
            kept = ref > floor + step
            assert kept.sum() > 10
            assert np.abs(lp[kept] - ref[kept]).max() <= step / 2 + 1e-4
