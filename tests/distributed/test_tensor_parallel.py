"""Tensor parallelism with gloo on the CPU (one thread per rank): greedy tokens equal TP=1 on a tiny
random Llama (TP=2 over 4 KV heads) and on the embedded model (TP=3 over its 3 KV heads), through
chunked prefill and preemption, and with speculative decoding; head counts that do not divide are
refused; a worker that dies
fails the next step with an error instead of hanging."""

from __future__ import annotations

import pytest
import torch

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.llm import LLM
from octavo.sampling.params import SamplingParams
from octavo.tokenizer import synthetic_tokenizer
from tests.oracle.reference import TIE_TOLERANCE

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    synthetic_tokenizer(101).save_pretrained(path)
    return path


def run(model: str | None, tp: int, prompts, **kwargs):
    kwargs.setdefault("quantization", "none")
    kwargs.setdefault("activation_dtype", "float32")  # the exact path (auto picks int8 on some CPUs)
    kwargs.setdefault("kv_cache_dtype", "float32")  # and its cache (auto picks float16)
    engine = LLMEngine.from_args(EngineArgs(model=model, tensor_parallel_size=tp, dtype="float32", **kwargs))
    try:
        outs = LLM.from_engine(engine).generate(prompts, PARAMS, use_tqdm=False)
        return [o.outputs[0] for o in outs], engine.get_stats()
    finally:
        engine.close()


def assert_same_or_near_tie(got, expected):
    """Token-exact, except a divergence where TP=1's two best logprobs were within the oracle's
    tie tolerance (a different summation order may flip a near-tie)."""
    for g, e in zip(got, expected):
        if g.token_ids == e.token_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b)
        top = sorted(e.logprobs[i].top.values(), reverse=True)
        assert top[0] - top[1] < TIE_TOLERANCE, f"diverged at {i} without a near-tie: {g.token_ids} vs {e.token_ids}"


def test_tp2_equals_tp1_on_a_tiny_llama_with_chunks_and_preemption(tiny_dir):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    kwargs = dict(block_size=8, max_num_batched_tokens=16, num_kv_blocks=9)
    expected, _ = run(str(tiny_dir), 1, prompts, **kwargs)
    got, stats = run(str(tiny_dir), 2, prompts, **kwargs)
    assert stats.scheduler.preemption.num_preemptions > 0
    assert_same_or_near_tie(got, expected)


def test_tp2_with_speculative_decoding_equals_tp1_without(tiny_dir):
    """Every rank runs the verification step (drafts in the step's tokens); rank 0 keeps them."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() * 3 for n in (4, 7, 11)]  # repeats to draft from
    expected, _ = run(str(tiny_dir), 1, prompts, block_size=8)
    got, stats = run(str(tiny_dir), 2, prompts, block_size=8, speculative_method="ngram", speculative_max_batch=8)
    assert stats.spec.num_accepted_tokens > 0
    assert_same_or_near_tie(got, expected)


def test_tp3_equals_tp1_on_the_embedded_model(smol_tokenizer):
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    expected, _ = run(None, 1, prompts, kv_cache_memory=64 << 20)
    got, _ = run(None, 3, prompts, kv_cache_memory=64 << 20, max_num_batched_tokens=8)
    assert_same_or_near_tie(got, expected)


def test_tp3_with_quantized_gguf_shards_equals_tp1_quantized(smol_tokenizer):
    """The embedded model's Q4_1 / Q8_0 blocks sharded by whole blocks (no dense copy on any rank)."""
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    expected, _ = run(None, 1, prompts, kv_cache_memory=64 << 20, quantization="auto")
    engine = LLMEngine.from_args(EngineArgs(tensor_parallel_size=3, dtype="float32", quantization="auto", activation_dtype="float32", kv_cache_dtype="float32",
                                            kv_cache_memory=64 << 20, max_num_batched_tokens=8))
    try:
        from octavo.models.layers import QuantLinear

        assert sum(isinstance(m, QuantLinear) for m in engine.runner.model.modules()) >= 120
        outs = LLM.from_engine(engine).generate(prompts, PARAMS, use_tqdm=False)
    finally:
        engine.close()
    assert_same_or_near_tie([o.outputs[0] for o in outs], expected)


def test_quantized_shares_off_the_block_grid_are_refused_by_name(tiny_dir):
    with pytest.raises(ValueError, match="down_proj, not whole quantized blocks of 32"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_dir), tensor_parallel_size=2, dtype="float32", quantization="int8"))


def test_head_counts_that_do_not_divide_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_dir), tensor_parallel_size=3, dtype="float32"))


def test_a_dead_worker_fails_the_step(tiny_dir):
    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_dir), tensor_parallel_size=2, dtype="float32"))
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        engine.step()
        worker = engine.executor.group.procs[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="worker .* died"):
            for _ in range(50):
                engine.step()
    finally:
        engine.close()


def test_two_nodes_under_torchrun_equal_one_process(tmp_path):
    """Two torchrun "nodes" on 127.0.0.1 (node 0: the engine, rank 0; node 1: ranks 1 and 2) run
    `octavo generate --tensor-parallel-size 3`; the answers equal a single process's."""
    import json
    import os
    import subprocess
    import sys

    from tests.live_server import free_port

    common = ["generate", "--prompt", "Name a colour.", "--max-tokens", "10", "--temperature", "0", "--json",
              "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", str(64 << 20)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "octavo.cli", *common], capture_output=True, text=True, env=env,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    port = str(free_port())
    nodes = []
    for node, nproc in ((0, 1), (1, 2)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", port,
               "-m", "octavo.cli", *common, "--tensor-parallel-size", "3"]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    expected = json.loads(single.stdout)["answers"]
    got = json.loads(outs[0][0][outs[0][0].index("{"):])["answers"]
    assert [a["text"] for a in got] == [a["text"] for a in expected]


def test_serve_with_tp_and_a_worker_killed_mid_run(tiny_dir, tmp_path):
    """`octavo serve --tensor-parallel-size 2` answers like TP=1; when a worker dies, requests get an
    error and the server exits non-zero (a supervisor restarts it), it does not hang."""
    import subprocess

    import httpx

    from tests.live_server import start_server

    expected, _ = run(str(tiny_dir), 1, [[5, 6, 7, 8]])
    server = start_server(tmp_path / "server.log", [str(tiny_dir), "--tensor-parallel-size", "2", "--dtype", "float32",
                                                    "--num-kv-blocks", "64", "--shutdown-timeout", "2"], threads=2)
    try:
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text == expected[0].text
        children = subprocess.run(["pgrep", "-P", str(server.process.pid)], capture_output=True, text=True).stdout.split()
        assert children, "no worker process found"
        for pid in children:
            subprocess.run(["kill", "-9", pid])
        failed = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 50}, timeout=60)
        assert failed.status_code >= 500
        assert server.process.wait(60) != 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
