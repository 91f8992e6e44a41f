"""LoRA adapters made with peft on the embedded model (seeded random, non-zero A and B, rank 8 on
q/k/v/o and the MLP; one with rslora and only some targets): Octavo's greedy tokens equal
transformers + peft with each adapter, in mixed batches of three adapters and the base model, with
chunked prefill, preemption and fewer slots than adapters (LRU swapping), and with speculative
decoding (each request's drafts verified with its adapter); the adapter is part of
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


@pytest.mark.parametrize("setting", ["one-step", "chunked-swapped-preempted", "speculative"])
def test_mixed_batch_equals_transformers_with_peft(lora_model, smol_dir, smol_tokenizer, adapters, setting):
    kwargs = {
        "one-step": dict(max_loras=4),
        "chunked-swapped-preempted": dict(max_loras=2, max_num_batched_tokens=16, num_kv_blocks=12, block_size=8,
                                          kv_cache_memory=None),
        # each request's drafts verified with its own adapter, in the same step as the others'
        "speculative": dict(max_loras=4, speculative_method="ngram", speculative_max_batch=16),
    }[setting]
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, **kwargs)
    for name, j, tokens in run_mixed(llm, adapters):
        assert tokens == adapters[name][1][j], (name, PROMPTS[j])
    stats = llm.engine.get_stats().scheduler
    if setting == "chunked-swapped-preempted":
        assert stats.preemption.num_preemptions > 0
        assert llm.engine.runner.lora.num_loads > 3  # 3 adapters through 2 slots: swapped back in
    if setting == "speculative":
        assert llm.engine.get_stats().spec.num_accepted_tokens > 0
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []


def test_the_adapter_is_part_of_every_block_hash(lora_model, smol_dir, smol_tokenizer, adapters):
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=2, block_size=8)
    prompt = smol_tokenizer.encode(" ".join(PROMPTS))  # several full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def hits(lora):
        before = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
        llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        return llm.engine.get_stats().scheduler.prefix.num_hits_tokens - before

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
    # PiSSA changes the base weights too: on the original base it would answer wrongly, silently
    (broken / "adapter_config.json").write_text(json.dumps({**conf, "init_lora_weights": "pissa_niter_4"}))
    with pytest.raises(ValueError, match="init_lora_weights 'pissa_niter_4'"):
        engine.add_lora(LoRARequest("pissa", 6, str(broken)))
    assert not engine.has_unfinished_requests()  # nothing was kept
    base_only = LLM.from_engine(LLMEngine(EngineArgs(dtype="float32", kv_cache_memory=64 << 20).to_config(
        load_model_config(smol_dir)), lora_model, smol_tokenizer, weight_bytes(lora_model)))
    with pytest.raises(ValueError, match="enable_lora"):
        base_only.generate("hi", lora_request=adapters["gamma"][0], use_tqdm=False)


def test_an_id_given_again_after_an_unload_never_meets_the_old_adapters_kv(lora_model, smol_dir, smol_tokenizer,
                                                                          adapters):
    """The prefix cache keys blocks by the adapter's files, not by its id: after alpha (id 7) is
    unloaded and beta is loaded as id 7, beta's request finds none of alpha's blocks (issue 20: it
    used to be served alpha's KV, and answered wrongly without an error); alpha loaded again finds
    its own (the same files make the same KV, which a second KV tier keeps across restarts)."""
    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=1, block_size=4)
    j = 2  # the longest prompt: several full blocks
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    alpha, beta = adapters["alpha"][0], adapters["beta"][0]

    def run(lora):
        before = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
        out = llm.generate([PROMPTS[j]], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
        return out, llm.engine.get_stats().scheduler.prefix.num_hits_tokens - before

    first_alpha = LoRARequest("alpha", 7, alpha.lora_path)
    assert run(first_alpha)[0] == adapters["alpha"][1][j]
    assert run(first_alpha)[1] > 0  # its blocks are cached...
    llm.engine.remove_lora(7)
    tokens, hits = run(LoRARequest("beta", 7, beta.lora_path))  # ...and the id now names beta
    assert hits == 0 and tokens == adapters["beta"][1][j]
    llm.engine.remove_lora(7)
    tokens, hits = run(LoRARequest("alpha", 7, alpha.lora_path))  # alpha again: its files, its key
    assert hits > 0 and tokens == adapters["alpha"][1][j]


def test_a_request_for_an_adapter_unloaded_on_its_way_is_refused_and_the_name_stays_free(
        lora_model, smol_dir, smol_tokenizer, adapters):
    """The server's race (issue 20): an unload applied before a queued request for that adapter
    reaches the engine. The request is refused (LoRANotLoadedError, a 404) instead of loading the
    adapter again behind the server's back, which left the name neither servable nor loadable."""
    import asyncio

    from octavo.metrics import EngineMetrics
    from octavo.server.async_engine import AsyncEngine, LoRANotLoadedError

    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=1)
    engine = llm.engine
    alpha = adapters["alpha"][0]
    engine.add_lora(alpha)
    ids = smol_tokenizer.encode(PROMPTS[0])

    async def scenario() -> None:
        served = AsyncEngine(engine, EngineMetrics("t"))
        served.start()
        try:
            unload = asyncio.ensure_future(served.remove_lora(alpha.lora_int_id))
            add = asyncio.ensure_future(served.add(["r1"], [ids], SamplingParams(max_tokens=2), lora_request=alpha))
            await unload
            with pytest.raises(LoRANotLoadedError, match="alpha"):
                await add
            assert engine.list_loras() == [] and not engine.has_unfinished_requests()
            again = LoRARequest("alpha", alpha.lora_int_id + 1, alpha.lora_path)
            await served.add_lora(again)
            collector = await served.add(["r2"], [ids], SamplingParams(max_tokens=2), lora_request=again)
            while await collector.next_batch():
                pass
        finally:
            served.shutdown()

    asyncio.run(scenario())


def _valid_adapter_copy(adapters, tmp_path, name: str):
    import shutil

    path = tmp_path / name
    shutil.copytree(adapters["gamma"][0].lora_path, path)
    return path


def test_malformed_adapter_files_are_refused_with_the_reason(smol_dir, adapters, tmp_path):
    """Every way an adapter's files can be wrong is a ValueError (the server's 400), never another
    exception (a 500): issue 20."""
    import torch
    from safetensors.torch import load_file, save_file

    from octavo.lora.adapter import load_peft_adapter

    cfg = load_model_config(smol_dir)
    base_conf = json.loads((_valid_adapter_copy(adapters, tmp_path, "probe") / "adapter_config.json").read_text())
    configs = {
        "not json": "{r: 4", "a list": "[1, 2]", "not utf-8": b"\xff\xfe{", "deep": "[" * 5000,
        "rank a string": json.dumps({**base_conf, "r": "four"}), "rank huge": '{"r": ' + "9" * 401 + "}",
        "rank fractional": json.dumps({**base_conf, "r": 2.5}), "alpha infinite": json.dumps({**base_conf, "lora_alpha": 1e400}),
        "peft type odd": json.dumps({**base_conf, "peft_type": ["x"]}),
    }
    for i, (why, text) in enumerate(configs.items()):
        path = _valid_adapter_copy(adapters, tmp_path, f"conf{i}")
        (path / "adapter_config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ValueError, match="LoRA adapter"):
            load_peft_adapter(path, 1, "x", cfg, 16)
    path = _valid_adapter_copy(adapters, tmp_path, "corrupt")
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(ValueError, match="cannot be read"):
        load_peft_adapter(path, 1, "x", cfg, 16)
    for why, change in (("NaN", lambda t: t * float("nan")), ("integers", lambda t: t.to(torch.int32))):
        path = _valid_adapter_copy(adapters, tmp_path, why)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        first = sorted(tensors)[0]
        tensors[first] = change(tensors[first])
        save_file(tensors, str(path / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match="NaN|floating point"):
            load_peft_adapter(path, 1, "x", cfg, 16)


def test_adapters_in_use_reach_lora_requests_info_and_kv_events(lora_model, smol_dir, smol_tokenizer, adapters):
    """Three adapters through two slots: the gamma request waits while alpha's and beta's run,
    which vLLM's lora_requests_info (what an endpoint picker routes adapters by) reports by name;
    and each stored block's KV event names its adapter."""
    from prometheus_client import generate_latest

    from octavo.kv_cache.events import BlockStored
    from octavo.metrics import EngineMetrics

    llm = lora_llm(lora_model, smol_dir, smol_tokenizer, max_loras=2, max_num_seqs=4)
    engine = llm.engine
    log = engine.scheduler.kv_cache.enable_events()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = smol_tokenizer.encode(" ".join(PROMPTS))  # several full blocks
    for name in ("alpha", "beta", "gamma"):
        engine.add_request(name, prompt, params, lora_request=adapters[name][0])
    engine.step()
    lora = engine.get_stats().lora
    assert (lora.max_loras, lora.running, lora.waiting) == (2, ("alpha", "beta"), ("gamma",))
    metrics = EngineMetrics("smol", "vllm")
    metrics.observe_step(engine.get_stats())
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="alpha,beta",waiting_lora_adapters="gamma"}' in text
    stored = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert {e.lora_id for e in stored} == {1, 2} and all(e.token_ids for e in stored)
    assert {engine.lora_name(e.lora_id) for e in stored} == {"alpha", "beta"}
    while engine.has_unfinished_requests():
        engine.step()
    metrics.observe_step(engine.get_stats())
    text = generate_latest(metrics.registry).decode()
    assert text.count("vllm:lora_requests_info{") == 1  # one series, the latest (the picker reads the newest)
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in text
