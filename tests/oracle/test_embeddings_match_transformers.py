"""Embeddings against the oracle: Octavo's pooled final hidden states equal transformers' (its base
model's last_hidden_state, pooled the same way), cosine >= 0.99999 in float32, one prompt at a
time and batched, chunked, sharing a prefix-cached prompt, preempted, and in the same batches as
greedy generation (which still matches transformers token for token)."""

from __future__ import annotations

import math

import pytest
import torch

from octavo.models.loader import default_gguf_path
from octavo.sampling.params import PoolingParams, SamplingParams
from tests.oracle.reference import cached, cached_greedy, model_key, oracle_prompts
from tests.oracle.test_greedy_matches_transformers import GREEDY, check_all

MIN_COSINE = 0.99999
TYPES = ("last", "mean", "cls")


@pytest.fixture(scope="module")
def prompts(smol):
    return oracle_prompts(smol[1])


def _hf_embeddings(model, prompts: list[list[int]]) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {t: [] for t in TYPES}
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0].float()  # [len, hidden]
            for kind, vec in (("last", hidden[-1]), ("mean", hidden.mean(dim=0)), ("cls", hidden[0])):
                out[kind].append(torch.nn.functional.normalize(vec, dim=0).tolist())
    return out


@pytest.fixture(scope="module")
def refs(request, prompts):
    key = {"model": model_key(default_gguf_path()), "prompts": prompts}
    return cached("embeddings", key, lambda: _hf_embeddings(request.getfixturevalue("hf_smol"), prompts))


@pytest.fixture(scope="module")
def greedy_refs(request, prompts):
    return cached_greedy(lambda: request.getfixturevalue("hf_smol"), default_gguf_path(), prompts)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def check(outs, refs, kind: str, mode: str) -> None:
    low = [(i, cosine(o.embedding, r)) for i, (o, r) in enumerate(zip(outs, refs[kind][: len(outs)], strict=True))]
    bad = [(i, c) for i, c in low if c < MIN_COSINE]
    assert not bad, f"[{mode}, {kind}] prompts below cosine {MIN_COSINE}: {bad}"
    assert all(abs(sum(x * x for x in o.embedding) - 1) < 1e-4 for o in outs)  # normalised


@pytest.mark.parametrize("kind", TYPES)
def test_plain_batched_and_chunked(make_llm, prompts, refs, kind):
    llm = make_llm()
    check(llm.embed(prompts, PoolingParams(kind), use_tqdm=False), refs, kind, "one batch")
    check([llm.embed([p], PoolingParams(kind), use_tqdm=False)[0] for p in prompts[:3]], refs, kind, "one at a time")
    chunked = make_llm(max_num_batched_tokens=48)  # every prompt over 48 tokens pooled across chunks
    check(chunked.embed(prompts, PoolingParams(kind), use_tqdm=False), refs, kind, "budget 48")


def test_beside_generation_with_prefix_caching_and_preemption(make_llm, prompts, refs, greedy_refs):
    """Embedding and generation requests in the same steps, on a pool small enough to preempt;
    the prompts' blocks cached by generation are hit by last-token pooling (mean and cls compute
    every position)."""
    llm = make_llm(num_kv_blocks=64, max_num_batched_tokens=96)
    mixed = [GREEDY] * len(prompts) + [SamplingParams(max_tokens=1, pooling=PoolingParams(k)) for k in TYPES
                                       for _ in prompts]
    outs = llm.generate(prompts * 4, mixed, use_tqdm=False)
    check_all(outs[: len(prompts)], greedy_refs, "beside embeddings")
    for j, kind in enumerate(TYPES):
        got = outs[len(prompts) * (j + 1): len(prompts) * (j + 2)]
        assert all(o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "stop" for o in got)
        check(got, refs, kind, "beside generation")
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
    roomy = make_llm()
    roomy.generate(prompts, GREEDY, use_tqdm=False)  # their blocks are cached now
    again = roomy.embed(prompts, PoolingParams("last"), use_tqdm=False)
    check(again, refs, "last", "prefix-cache hits")
    assert sum(o.num_cached_tokens for o in again) >= sum(len(p) // 16 * 16 for p in prompts) - 16 * len(prompts)
    assert sum(o.num_cached_tokens for o in roomy.embed(prompts, PoolingParams("mean"), use_tqdm=False)) == 0


def test_dimensions_and_unnormalised(make_llm, prompts, refs):
    llm = make_llm()
    raw = llm.embed(prompts[:2], PoolingParams("last", normalize=False), use_tqdm=False)
    assert abs(sum(x * x for x in raw[0].embedding) - 1) > 1e-3
    assert cosine(raw[1].embedding, refs["last"][1]) >= MIN_COSINE
    cut = llm.embed(prompts[:2], PoolingParams("last", dimensions=64), use_tqdm=False)
    assert len(cut[0].embedding) == 64 and cosine(cut[0].embedding, refs["last"][0][:64]) >= MIN_COSINE
