"""Beam search inside the engine returns what transformers' `generate(num_beams=W,
num_return_sequences=W, do_sample=False, early_stopping=...)` returns on the embedded model: the same
W token sequences in the same order (EOS included, as transformers ends them) with the same scores
(cum_logprob / generated_len ** length_penalty), under each of transformers' stopping rules
(early_stopping True, False and "never"), with beams batched together, chunked prefill and
preemption."""

from __future__ import annotations

import pytest
import torch

from octavo.models.loader import default_gguf_path
from octavo.sampling.params import BeamSearchParams
from octavo.tokenizer import apply_chat_template
from tests.oracle.reference import cached, model_key

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    chats = ["Say hello.", "What is 2 + 2? Answer with a number.", "Name a colour."]
    return [apply_chat_template(smol_tokenizer, [{"role": "user", "content": c}]) for c in chats] + [
        smol_tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):")
    ]


def hf_beams(model, prompt: list[int], params: BeamSearchParams) -> tuple[list[list[int]], list[float]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=params.beam_width,
            num_return_sequences=params.beam_width, early_stopping=params.early_stopping,
            length_penalty=params.length_penalty, max_new_tokens=params.max_tokens, pad_token_id=2,
            output_scores=True, return_dict_in_generate=True,
        )
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        seqs.append(row[: row.index(2) + 1] if 2 in row else row)  # transformers pads after the EOS
    return seqs, out.sequences_scores.tolist()


CASES = [
    BeamSearchParams(2, MAX_TOKENS, early_stopping=False),
    BeamSearchParams(4, MAX_TOKENS, early_stopping=True, length_penalty=0.5),
    BeamSearchParams(3, MAX_TOKENS, early_stopping="never", length_penalty=1.5),
]


@pytest.fixture(scope="module")
def expected(request, prompts):
    """transformers' beams for every case and prompt (kept between runs: tests/oracle/reference.py)."""
    def compute(params: BeamSearchParams):
        return lambda: [hf_beams(request.getfixturevalue("hf_smol"), prompt, params) for prompt in prompts]

    key = {"model": model_key(default_gguf_path()), "prompts": prompts}
    return {p: [tuple(r) for r in cached("beams", {**key, "params": repr(p)}, compute(p))] for p in CASES}


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"w{p.beam_width}-es{p.early_stopping}-lp{p.length_penalty}")
def test_beams_equal_transformers(make_llm, prompts, expected, params):
    llm = make_llm()
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    for out, (seqs, scores) in zip(outputs, expected[params]):
        assert [c.token_ids for c in out.outputs] == seqs
        ours = [c.cumulative_logprob / len(c.token_ids) ** params.length_penalty for c in out.outputs]
        assert ours == pytest.approx(scores, abs=1e-4)
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
            assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_some_beams_end_on_eos(expected):
    """The EOS rule is exercised: some returned hypotheses end on EOS before max_tokens."""
    ended = [s for p in CASES for seqs, _ in expected[p] for s in seqs if s[-1] == 2 and len(s) < MAX_TOKENS]
    assert ended


def test_beams_batched_with_other_requests_chunked_and_preempted(make_llm, prompts, expected):
    from octavo.sampling.params import SamplingParams

    params = CASES[1]
    llm = make_llm(max_num_batched_tokens=24, num_kv_blocks=20, block_size=16)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"beam{i}", prompt, params)
        engine.add_request(f"plain{i}", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    done, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        preemptions = max(preemptions, engine.get_stats().scheduler.preemption.num_preemptions)
    assert preemptions > 0
    for i, (seqs, _) in enumerate(expected[params]):
        assert [c.token_ids for c in done[f"beam{i}"].outputs] == seqs
    assert engine.scheduler.kv_cache.view().check_invariants() == []
