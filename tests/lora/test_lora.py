"""LoRA adapters made with peft on the embedded model (seeded random, non-zero A and B, rank 8 on
q/k/v/o and the MLP; one with rslora and only some targets): Octavo's greedy tokens equal
transformers + peft with each adapter, in mixed batches of three adapters and the base model, with
chunked prefill, preemption and fewer slots than adapters (LRU swapping); the adapter is part of
every block hash; bad adapters are refused with the reason."""

from __future__ import annotations

import json

import pytest

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.llm import LLM
from octavo.lora.request import LoRARequest
from octavo.models.loader import load_model, weight_bytes
from octavo.models.registry import load_model_config
from octavo.sampling.params import SamplingParams
from tests.lora.conftest import ADAPTERS, NUM_NEW, PROMPTS


@pytest.fixture(scope="module")
def lora_model(smol_dir):
    """A model of its own: enabling LoRA wraps the projections in place."""
    model, _ = load_model(smol_dir, quantization="auto")
    return model


def lora_llm(lora_model, smol_dir, smol_tokenizer, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 128 << 20)
    args = EngineArgs(dtype="float32", enable_lora=True, **kwargs)
    return LLM.from_engine(LLMEngine(args.to_config(load_model_config(smol_dir)), lora_model, smol_tokenizer,
                                     weight_bytes(lora_model)))


def run_mixed(llm: LLM, adapters) -> list[tuple[str | None, int, list[int]]]:
    names = [None, "alpha", "beta", "gamma"]
    prompts, loras, keys = [], [], []
    for j, prompt in enumerate(PROMPTS):
        for k, name in enumerate(names):
            name = names[(j + k) % len(names)]
            prompts.append(prompt)
            loras.append(adapters[name][0])
            keys.append((name, j))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    return [(name, j, o.outputs[0].token_ids) for (name, j), o in zip(keys, outs)]


def test_each_adapter_changes_the_output(adapters):
    base = adapters[None][1]
    for name in ADAPTERS:
        assert adapters[name][1] != base, name


@pytest.mark.parametrize("setting", ["one-step", "chunked-swapped-preempted"])
def test_mixed_batch_equals_transformers_with_peft(lora_model, smol_dir, smol_tokenizer, adapters, setting):
    kwargs = dict(max_loras=4) if setting == "one-step" else dict(
        max_loras=2, max_num_batched_tokens=16, num_kv_blocks=12, block_size=8, kv_cache_memory=None)
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, **kwargs)
    for name, j, tokens in run_mixed(llm, adapters):
        assert tokens == adapters[name][1][j], (name, PROMPTS[j])
    stats = llm.engine.get_stats().scheduler
    if setting != "one-step":
        assert stats.num_preemptions > 0
        assert llm.engine.runner.lora.num_loads > 3  # 3 adapters through 2 slots: swapped back in
    assert llm.engine.scheduler.kv_cache.check_invariants() == []


def test_the_adapter_is_part_of_every_block_hash(lora_model, smol_dir, smol_tokenizer, adapters):
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=2, block_size=8)
    prompt = smol_tokenizer.encode(" ".join(PROMPTS))  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits(lora):
        before = llm.engine.get_stats().scheduler.prefix_cache_hits
        llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return llm.engine.get_stats().scheduler.prefix_cache_hits - before

    alpha, beta = adapters["alpha"][0], adapters["beta"][0]
    assert hits(alpha) == 0
    assert hits(beta) == 0 and hits(None) == 0  # same tokens, another adapter / the base: no sharing
    assert hits(alpha) > 0 and hits(None) > 0  # the same adapter (and the base) again: shared


def test_bad_adapters_are_refused_with_the_reason(lora_model, smol_dir, smol_tokenizer, adapters, tmp_path):
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=1, max_lora_rank=4)
    engine = llm.engine
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_request("x", "hi", lora_request=LoRARequest("nowhere", 9, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="rank 8 exceeds --max-lora-rank 4"):
        engine.add_request("x", "hi", lora_request=adapters["alpha"][0])
    broken = tmp_path / "broken"
    broken.mkdir()
    conf = {"r": 4, "lora_alpha": 8}
    (broken / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    (broken / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="DoRA is not supported"):
        engine.add_lora(LoRARequest("dora", 5, str(broken)))
    assert not engine.has_unfinished_requests()  # nothing was kept
    base_only = LLM.from_engine(LLMEngine(EngineArgs(dtype="float32", kv_cache_memory=64 << 20).to_config(
        load_model_config(smol_dir)), lora_model, smol_tokenizer, weight_bytes(lora_model)))
    with pytest.raises(ValueError, match="enable_lora"):
        base_only.generate("hi", lora_request=adapters["gamma"][0], use_tqdm=False)
