"""Structured outputs on the embedded model: every sampled output obeys its constraint, the mask is
applied to the whole batch at once (and equals xgrammar's own kernel), and batching, n > 1,
preemption, chunked prefill and prefix caching do not change greedy constrained output."""

import json
import re

import jsonschema
import pytest
import torch

from octavo.sampling.params import SamplingParams, StructuredOutputsParams
from octavo.sampling.sampler import apply_token_bitmask
from octavo.structured.manager import GrammarError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer"}},
                "required": ["kind", "legs"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


def test_bitmask_matches_xgrammar_kernel():
    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([1, 4, 5])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    ours = apply_token_bitmask(logits, rows, bitmask)
    theirs = logits.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)  # xgrammar indexes both by row
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist())
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.isinf(ours[rows]).any() and not torch.isinf(ours[[0, 2, 3]]).any()


def test_sampled_json_validates(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(["A person as JSON:", "Tell me about Ann."], params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 8 and len(set(texts)) > 1
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.engine.structured.num_matchers == 0  # finished sequences forget their matchers


def test_regex_choice_grammar_and_json_object(make_llm):
    llm = make_llm()
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5}-\d{3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", t)),
        (StructuredOutputsParams(choice=["sunny", "rainy", "snowy day"]), lambda t: t in ("sunny", "rainy", "snowy day")),
        (StructuredOutputsParams(grammar='root ::= item ("," item)?\nitem ::= "x" [0-9] [0-9]?'), lambda t: re.fullmatch(r"x\d\d?(,x\d\d?)?", t)),
    ]
    for so, ok in cases:
        outs = llm.generate(["The weather today is"] * 3, SamplingParams(temperature=0.7, seed=1, max_tokens=250, structured_outputs=so),
                            use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (so.kind, o.outputs[0].text)
    # any JSON object: free-form objects from a small model run long when sampled, so greedy here
    out = llm.generate(["A JSON object with a person's name and age:"], SamplingParams(
        temperature=0, max_tokens=250, structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop" and isinstance(json.loads(out[0].outputs[0].text), dict)


LONG = {"type": "object", "properties": {"names": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                  "minItems": 12, "maxItems": 12}},
        "required": ["names"], "additionalProperties": False}  # long enough output to run out of blocks


def _greedy(llm, prompts, schema=LONG, n=1):
    temp = 0.0 if n == 1 else 1.0
    params = SamplingParams(temperature=temp, seed=3, n=n, max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema))
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_preemption_chunking_and_prefix_hits_do_not_change_constrained_output(make_llm):
    shared = "You are a helpful assistant that writes JSON records about people. " * 6
    prompts = [shared + f"Record number {i}:" for i in range(6)]
    want = [_greedy(make_llm(), [p])[0] for p in prompts]  # one at a time, no pressure
    llm = make_llm(num_kv_blocks=22, max_num_batched_tokens=48)
    got = _greedy(llm, prompts)
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.prefix.num_hits_tokens > 0
    assert got == want
    # n > 1 with a seed: each completion keeps its own matcher through forks and preemption
    want_n = _greedy(make_llm(), prompts[:3], n=3)
    llm = make_llm(num_kv_blocks=22, max_num_batched_tokens=48)
    assert _greedy(llm, prompts[:3], n=3) == want_n
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0


def test_matcher_follows_tokens_back_and_forth(make_llm):
    """A sequence whose tokens were dropped (rolled back, or rebuilt beyond the rollback window)
    gets the same mask as a fresh matcher at that point."""
    llm = make_llm()
    manager = llm.engine.structured
    so = StructuredOutputsParams(json=SCHEMA)
    out = llm.generate(["A person:"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    for cut in (len(tokens) - 2, 3):
        manager.bitmask([("s", so, tokens)])
        ahead_then_back = manager.bitmask([("s", so, tokens[:cut])])
        fresh = manager.bitmask([("fresh", so, tokens[:cut])])
        manager.forget(["fresh"])
        assert torch.equal(ahead_then_back, fresh)
    manager.forget(["s"])


def test_bad_constraints_are_refused_before_anything_runs(make_llm):
    llm = make_llm()
    for so, words in [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {}}}}), "`not`"),
        (StructuredOutputsParams(json={"type": "nope"}), "invalid JSON schema"),
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    ]:
        with pytest.raises(GrammarError, match=re.escape(words)):
            llm.generate(["x", "y"], SamplingParams(structured_outputs=so), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_match_a_full_forward(make_llm):
    """prompt_logprobs are each prompt token's logprob given the tokens before it, whatever the
    chunking; prefix-cache hits are not taken for such requests."""
    from octavo.tokenizer import encode_prompt

    prompt = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
    one = make_llm(max_num_batched_tokens=512).generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    llm = make_llm(max_num_batched_tokens=8, block_size=4)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # caches its blocks
    chunked = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    ids = encode_prompt(llm.get_tokenizer(), prompt)
    assert one.prompt_logprobs[0] is None and len(one.prompt_logprobs) == len(ids)
    assert [lp.token_id for lp in one.prompt_logprobs[1:]] == ids[1:]
    assert chunked.num_cached_tokens == 0
    for a, b in zip(one.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and len(a.top) == 3 and list(a.top) == list(b.top)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert a.logprob <= max(a.top.values()) + 1e-6


def _whitespace_outside_strings(text: str) -> list[tuple[str, str]]:
    """(the character before, the whitespace run) for each run of whitespace outside JSON strings."""
    runs, i, in_string = [], 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            i += 2 if c == "\\" else 1
            in_string = c != '"'
            continue
        if c == '"':
            in_string = True
        elif c.isspace():
            j = i
            while j < len(text) and text[j].isspace():
                j += 1
            runs.append((text[i - 1] if i else "", text[i:j]))
            i = j
            continue
        i += 1
    return runs


def test_json_is_written_on_one_line(make_llm):
    """Issue 20: with whitespace allowed between tokens a small model sampling at temperature 1 put
    newlines anywhere, doubling small objects. JSON is one line, ", " and ": " its only spaces."""
    llm = make_llm()
    params = SamplingParams(temperature=1.0, seed=11, n=6, max_tokens=300,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for out in llm.generate(["A person as JSON:"], params, use_tqdm=False)[0].outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert all(before in ",:" and run == " " for before, run in _whitespace_outside_strings(out.text)), out.text


def test_a_complete_grammar_ends_with_eos_even_under_min_tokens(make_llm):
    """Issue 20: once the grammar is complete only EOS may follow, and min_tokens bans EOS: no token
    was left and the draw took token 0. The grammar wins: EOS comes back to that row, and (issue 36)
    the request ends there (it repeated EOS until min_tokens)."""
    llm = make_llm()
    params = SamplingParams(temperature=0, min_tokens=6, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
    out = llm.generate(["Is water wet? Answer yes or no."], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    eos = set(llm.engine.eos_token_ids)
    chosen = llm.engine.tokenizer.encode(out.text, add_special_tokens=False)
    tail = out.token_ids[len(chosen):] if out.token_ids[:len(chosen)] == chosen else out.token_ids[-4:]
    assert len(tail) == 1 and set(tail) <= eos and out.finish_reason == "stop", (out.token_ids, eos, out.finish_reason)
    assert 0 not in out.token_ids or 0 in eos
