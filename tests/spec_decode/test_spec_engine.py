"""Speculative decoding on the embedded model, beside the same requests without it: seeded samples,
logprobs, stop conditions and structured outputs come out the same, drafts are kept only where
the model agrees, and the grammar cuts drafts it would refuse."""

import json

import jsonschema
import pytest

from octavo.sampling.params import SamplingParams, StructuredOutputsParams

# a prompt whose answer copies spans of it: drafts from prompt lookup are often right
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
COPY_PROMPT = f"Here is some code:\n\n{CODE}\nRepeat the code above exactly:\n\n"


def spec_counts(llm):
    s = llm.engine.get_stats().spec
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def tokens_of(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture
def plain(make_llm):
    return make_llm()


@pytest.fixture
def spec(make_llm):
    return make_llm(speculative_method="ngram", num_speculative_tokens=4, speculative_max_batch=16)


def test_seeded_samples_are_the_same_with_and_without_drafts(plain, spec):
    """A seeded sequence's generator is rewound to its last kept token, so each position draws
    the noise it would draw without speculation: the same tokens, penalties and top-p included."""
    params = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.2, seed=11, n=2, max_tokens=48)
    prompts = [COPY_PROMPT, "Write a short poem about the sea."]
    before = spec_counts(spec)
    got = tokens_of(spec.generate(prompts, params, use_tqdm=False))
    drafts, drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before))
    assert drafts > 0 and accepted > 0
    assert got == tokens_of(plain.generate(prompts, params, use_tqdm=False))


def test_logprobs_stop_strings_and_max_tokens_match(plain, spec):
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=60, stop=["mul"]),  # a stop string inside a run of kept drafts
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    for p in params:
        want = plain.generate([COPY_PROMPT], p, use_tqdm=False)[0].outputs[0]
        got = spec.generate([COPY_PROMPT], p, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == want.finish_reason
        if p.logprobs:
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert a.top.keys() == b.top.keys()
    assert len(got.token_ids) == 7
    assert spec_counts(spec)[2] > 0


LIST = {"type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                   "minItems": 9, "maxItems": 9}},
        "required": ["names"], "additionalProperties": False}


def test_structured_outputs_with_drafts(plain, spec):
    """Greedy constrained output is unchanged; sampled constrained output always validates; drafts
    are cut where the grammar refuses them (the matcher is rolled back after each check)."""
    so = StructuredOutputsParams(json=LIST)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    prompt = ["A JSON list of nine names:"]
    assert tokens_of(spec.generate(prompt, greedy, use_tqdm=False)) == tokens_of(plain.generate(prompt, greedy, use_tqdm=False))
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=120, structured_outputs=so)
    before = spec_counts(spec)
    for out in spec.generate(prompt * 2, sampled, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), LIST)
    assert spec_counts(spec)[2] > before[2]
    assert spec.engine.structured.num_matchers == 0


def test_grammar_cuts_drafts_it_refuses(spec):
    engine = spec.engine
    so = StructuredOutputsParams(choice=["alpha beta", "gamma"])
    tok = engine.tokenizer
    good = tok.encode("alpha beta", add_special_tokens=False)
    bad = tok.encode("alpha gamma", add_special_tokens=False)
    assert engine.structured.draft_prefix("x", so, [], good) == good
    cut = engine.structured.draft_prefix("x", so, [], bad)
    assert cut == bad[: len(cut)] and len(cut) < len(bad)
    # the matcher stayed where the output ends: the whole good answer is still allowed
    assert engine.structured.draft_prefix("x", so, [], good) == good
    engine.structured.forget(["x"])


def test_a_draft_model_drafts_for_the_target(plain, make_llm, smol_dir):
    """--speculative-method draft with the embedded model drafting for itself (a copy with its own
    KV cache, greedy): greedy output unchanged with every draft kept; seeded sampled output
    unchanged while the sampled target refuses some greedy drafts (the rejection rule at work)."""
    llm = make_llm(speculative_method="draft", speculative_model=str(smol_dir), speculative_max_batch=8)
    prompts = [COPY_PROMPT, "Write a short poem about the sea.", "The three largest cities in Europe are"]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert tokens_of(llm.generate(prompts, greedy, use_tqdm=False)) == tokens_of(plain.generate(prompts, greedy, use_tqdm=False))
    drafts, drafted, accepted = spec_counts(llm)
    assert drafts > 0 and accepted == drafted
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    assert tokens_of(llm.generate(prompts, seeded, use_tqdm=False)) == tokens_of(plain.generate(prompts, seeded, use_tqdm=False))
    _, drafted_after, accepted_after = spec_counts(llm)
    assert 0 < accepted_after - accepted < drafted_after - drafted


def test_draft_model_options_are_checked():
    from octavo.engine_args import EngineArgs

    with pytest.raises(ValueError, match="needs --speculative-model"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(ValueError, match="needs --speculative-method draft"):
        EngineArgs(speculative_method="ngram", speculative_model="x")
