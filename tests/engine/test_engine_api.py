"""LLMEngine / LLM behaviour on the embedded model: stops, aborts, refusals, seeds, n, logprobs, chat."""

import pytest

from octavo.sampling.params import SamplingParams

PROMPT = "The history of the printing press begins"


def test_stop_string_cuts_text_and_finishes_with_stop(make_llm):
    llm = make_llm()
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    assert len(words) > 4, free.text
    stop = words[3]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert len(out.token_ids) < len(free.token_ids)


def test_max_tokens_and_stop_token_ids(make_llm):
    llm = make_llm()
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    toks = base.outputs[0].token_ids
    assert len(toks) == 12 and base.outputs[0].finish_reason == "length"
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[5]]), use_tqdm=False)[0]
    first = toks.index(toks[5])
    assert out.outputs[0].token_ids == toks[: first + 1] and out.outputs[0].stop_reason == toks[5]


def test_too_long_prompt_is_refused_with_both_lengths_and_nothing_is_kept(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt 1: the prompt has 70 tokens but max_model_len is 64"):
        llm.generate([[1, 2, 3], list(range(70))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache.num_free_blocks == llm.engine.scheduler.kv_cache.num_blocks
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 49152\)"):
        llm.generate([[1, 99999]], use_tqdm=False)


def test_abort_frees_blocks_at_once(make_llm):
    llm = make_llm()
    engine = llm.engine
    kv = engine.scheduler.kv_cache
    engine.add_request("x", list(range(100, 180)), SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("y", list(range(300, 340)), SamplingParams(temperature=0, max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    assert kv.num_free_blocks < kv.num_blocks
    engine.abort_request(["x", "y"])
    assert kv.num_free_blocks == kv.num_blocks and not engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20)
    mixed = llm.generate(["Hello there", PROMPT, "Another prompt entirely"], [others, seeded, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    different = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=99), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_n_samples_differ_and_all_blocks_return(make_llm):
    llm = make_llm()
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=7, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    kv = llm.engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_logprobs_match_a_recomputed_log_softmax(make_llm, smol):
    llm = make_llm()
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for lp, tok in zip(comp.logprobs, comp.token_ids):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob, abs=1e-5)  # greedy: the best one
        assert lp.logprob <= 0


def test_prefix_cache_hits_cached_tokens_and_salt_isolation(make_llm):
    llm = make_llm()
    prompt = list(range(1000, 1100))
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    salted = llm.generate([prompt], params, use_tqdm=False, cache_salt="tenant-b")[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 96 and salted.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    llm.reset_prefix_cache()
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_chat_template_and_timing(make_llm):
    llm = make_llm()
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time


def test_stats_report_usage_and_tokens(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("s", list(range(50, 90)), SamplingParams(temperature=0, max_tokens=5))
    engine.step()
    stats = engine.get_stats()
    assert stats.scheduler.num_running == 1 and stats.scheduler.kv_cache_usage > 0
    assert stats.num_prompt_tokens_total == 40 and stats.num_generation_tokens_total == 1
    engine.abort_request("s")
    assert engine.get_stats().scheduler.kv_cache_usage == 0


def test_unknown_attention_backend_is_refused_with_the_choices():
    from octavo.engine_args import EngineArgs

    with pytest.raises(ValueError, match="auto, cpu, triton, reference"):
        EngineArgs(attention_backend="flash")


def test_values_that_used_to_kill_step_are_refused_or_safe(make_llm):
    # Each of these raised inside step() before (killing a server's engine thread for everyone).
    llm = make_llm(max_num_seqs=4)
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 49152\)"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"n \(5\) exceeds max_num_seqs \(4\)"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4), cache_salt="", use_tqdm=False)
    # the largest int64 seed plus the sample index of n=3 stays a valid generator seed
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=3, n=3, seed=2**63 - 1), use_tqdm=False)
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3]
    assert not llm.engine.has_unfinished_requests()


def test_delta_outputs_concatenate_to_the_cumulative_output(make_llm):
    from octavo.sampling.params import RequestOutputKind

    llm = make_llm()
    engine = llm.engine
    kinds = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA, "f": RequestOutputKind.FINAL_ONLY}
    for rid, kind in kinds.items():
        engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=20, n=2, logprobs=1,
                                                       stop=["never-there"], output_kind=kind))
    seen: dict[str, list] = {rid: [] for rid in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    final = seen["c"][-1]
    assert len(seen["f"]) == 1 and seen["f"][0].finished
    for i in range(2):
        deltas = [o.outputs[i] for o in seen["d"]]
        assert "".join(d.text for d in deltas) == final.outputs[i].text == seen["f"][0].outputs[i].text
        assert [t for d in deltas for t in d.token_ids] == final.outputs[i].token_ids
        assert len([lp for d in deltas for lp in d.logprobs]) == 20
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]


def test_stepping_on_another_thread_warns_once_per_move(make_llm, caplog):
    import threading

    engine = make_llm().engine
    engine.add_request("t", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with caplog.at_level("WARNING", logger="octavo"):
        engine.step()  # built on this thread: no warning
        assert "another thread" not in caplog.text
        worker = threading.Thread(target=lambda: [engine.step(), engine.step()])
        worker.start()
        worker.join()
    assert caplog.text.count("another thread") == 1


def test_vllm_prompt_dicts_and_python_dash_m(make_llm, smol_tokenizer):
    """vLLM's TextPrompt / TokensPrompt dicts (with cache_salt inside) give what plain prompts give;
    a malformed dict is refused naming it; `python -m octavo` is the `octavo` command."""
    import subprocess
    import sys

    from octavo.sampling.params import SamplingParams

    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = smol_tokenizer.encode("The sky is")
    text = "Water is wet and the sea is deep. " * 6  # several full blocks
    plain = llm.generate([ids, text], params, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text, "cache_salt": "tenant-a"}], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[1].num_cached_tokens == 0  # the dict's own salt: no hit on the unsalted run's blocks
    assert llm.generate([{"prompt": text}], params, use_tqdm=False)[0].num_cached_tokens > 0
    with pytest.raises(ValueError, match="prompt 0: a prompt dict needs exactly one of"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1]}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="keys \\['multi_modal_data'\\] are not supported"):
        llm.generate([{"prompt": "a", "multi_modal_data": {}}], params, use_tqdm=False)
    out = subprocess.run([sys.executable, "-m", "octavo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "serve" in out.stdout


def test_pinned_prefix_files_text_and_chat_messages(make_llm, tmp_path, caplog):
    """--pinned-prefix: a text file pinned as a completion prompt, a JSON file of messages as the
    chat template renders them; a chat request with that system prompt hits the pinned blocks;
    past the share, a clear refusal that pins nothing."""
    import json
    import logging

    from octavo.engine_setup import pin_prefix_files

    system = "You are the museum's guide. Answer in one short sentence, naming the room. " * 6
    (tmp_path / "doc.txt").write_text(PROMPT * 8)
    (tmp_path / "chat.json").write_text(json.dumps({"messages": [{"role": "system", "content": system}]}))
    llm = make_llm(num_kv_blocks=64)
    with caplog.at_level(logging.INFO, logger="octavo"):
        kv = llm.engine.scheduler.kv_cache
        pin_prefix_files(llm.engine.pin_prefix, kv, llm.engine.config.cache.pinned_prefix_share,
                         (str(tmp_path / "doc.txt"), str(tmp_path / "chat.json")))
    assert "pinned prefixes: doc.txt (" in caplog.text and "chat.json (" in caplog.text
    assert f"{kv.pins.num_blocks} of the pool's 64 blocks (at most 16" in caplog.text and kv.pins.num_blocks > 4
    out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": "Where is the clock?"}],
                   SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64
    with pytest.raises(ValueError, match="pinned share of the pool"):
        llm.pin_prefix(list(range(1000, 1000 + 16 * 20)))
    assert kv.pins.num_blocks <= 16 and kv.view().check_invariants() == []
