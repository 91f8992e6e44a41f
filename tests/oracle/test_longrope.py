"""LongRoPE with partial rotary (Phi-3 128k / Phi-3.5 / Phi-4-mini) from a GGUF written as llama.cpp's
converter writes it, against transformers on the same weights. transformers picks the short or the
long factor set per forward by the sequence's length; the paged cache keeps keys rotated once, so
Octavo picks once by the context it serves (llama.cpp's rule): the short set for a max_model_len
within the original context (64 here), else the long one. Each regime is compared where
transformers makes the same choice: sequences within 64 tokens, and prompts past 64."""

from __future__ import annotations

import random

import pytest
import torch

from octavo.sampling.params import SamplingParams
from tests.models.gguf_writer import hf_model, write_gguf
from tests.oracle.reference import compare, hf_greedy

NUM_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    from octavo.models.loader import load_model, resolve_model, weight_bytes
    from octavo.tokenizer import load_tokenizer

    hf = hf_model("phi3-longrope")
    path = tmp_path_factory.mktemp("longrope") / "phi3-longrope.gguf"
    write_gguf(hf, "phi3", path)
    model_dir = resolve_model(str(path))
    model, _ = load_model(model_dir, quantization="auto")
    return model_dir, model, load_tokenizer(model_dir), weight_bytes(model), hf


def build(phi, **kwargs):
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.llm import LLM
    from octavo.models.registry import load_model_config

    model_dir, model, tokenizer, nbytes, _ = phi
    kwargs.setdefault("num_kv_blocks", 64)
    config = EngineArgs(dtype="float32", **kwargs).to_config(load_model_config(model_dir))
    return LLM.from_engine(LLMEngine(config, model, tokenizer, nbytes))


def check(phi, llm, asked, mode):
    refs = hf_greedy(phi[-1], asked, NUM_NEW)
    outs = llm.generate(asked, GREEDY, use_tqdm=False)
    failures = [f"[{mode}] prompt {i} ({len(p)} tokens): {note}"
                for i, (p, out, ref) in enumerate(zip(asked, outs, refs, strict=True))
                for ok, note in [compare(list(out.outputs[0].token_ids), ref)] if not ok]
    assert not failures, "\n".join(failures)


def prompts(lengths):
    rng = random.Random(3)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def test_the_file_carries_longrope_and_partial_rotary(phi):
    from octavo.models.registry import load_model_config

    config = load_model_config(phi[0])
    rope = config.rope
    assert (rope.scaling_type, rope.original_max_position, config.rotary_dim, config.head_dim) == ("longrope", 64, 12, 16)
    assert rope.long and rope.long_factor[-1] == 32.0 and rope.short_factor[-1] == 2.5
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(64.0)).item()) ** 0.5)


def test_within_the_original_context_the_short_factors_equal_transformers(phi):
    asked = prompts((5, 20, 44))  # + 12 new: every sequence within 64
    llm = build(phi, max_model_len=64)
    assert not llm.engine.config.model_config.rope.long
    check(phi, llm, asked, "short, one batch")
    check(phi, build(phi, max_model_len=64, max_num_batched_tokens=16), asked, "short, budget 16")


def test_past_the_original_context_the_long_factors_equal_transformers(phi):
    asked = prompts((70, 100, 150))
    llm = build(phi)
    assert llm.engine.config.model_config.rope.long
    check(phi, llm, asked, "long, one batch")
    check(phi, build(phi, max_num_batched_tokens=16), asked, "long, budget 16")
    tiny = build(phi, num_kv_blocks=12, enable_prefix_caching=False, admission_headroom_steps=0)
    check(phi, tiny, asked, "long, tiny pool")
    assert tiny.engine.get_stats().scheduler.preemption.num_preemptions > 0


def test_the_two_factor_sets_give_different_models(phi):
    """Not vacuous: with the other set, the same long prompts give other tokens."""
    asked = prompts((70, 100, 150))
    llm = build(phi)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(asked, GREEDY, use_tqdm=False)]
    import dataclasses

    rotary = llm.engine.runner.model.rotary
    rotary.rope = dataclasses.replace(rotary.rope, long=False)
    rotary.reset_tables()
    other = [list(o.outputs[0].token_ids) for o in llm.generate(asked, GREEDY, use_tqdm=False)]
    assert any(a != b for a, b in zip(first, other))


def test_prefix_hits_and_n_2_past_the_original_context(phi):
    rng = random.Random(5)
    shared = [rng.randrange(97) for _ in range(80)]
    asked = [shared + [rng.randrange(97) for _ in range(n)] for n in (3, 20, 50)]
    llm = build(phi)
    check(phi, llm, asked, "long, shared prefix cold")
    hits = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
    check(phi, llm, asked, "long, shared prefix cached")
    assert llm.engine.get_stats().scheduler.prefix.num_hits_tokens - hits >= 80 * len(asked)
    refs = hf_greedy(phi[-1], asked, NUM_NEW)
    two = SamplingParams(n=2, temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for out, ref in zip(build(phi).generate(asked, two, use_tqdm=False), refs, strict=True):
        assert len(out.outputs) == 2
        for completion in out.outputs:
            ok, note = compare(list(completion.token_ids), ref)
            assert ok, note
