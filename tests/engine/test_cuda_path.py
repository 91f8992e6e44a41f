"""What only a GPU can show: CUDA graphs token-exact against eager, the memory-profiled KV sizing,
and seeded sampling with CUDA generators. Marked `gpu`: skipped without CUDA (scripts/gpu_check.sh
runs them on a GPU box)."""

from __future__ import annotations

import pytest
import torch

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.llm import LLM
from octavo.models.loader import model_from_hf, weight_bytes
from octavo.sampling.params import SamplingParams
from octavo.tokenizer import synthetic_tokenizer
from tests.engine.test_triton_backend import tiny_llama

pytestmark = pytest.mark.gpu


def engine(hf, dtype=torch.float32, **kwargs):
    model, model_config = model_from_hf(hf, dtype, "cuda")
    args = EngineArgs(device="cuda", dtype=str(dtype).removeprefix("torch."), **kwargs)
    return LLMEngine(args.to_config(model_config), model, synthetic_tokenizer(97), weight_bytes(model))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def test_cuda_graphs_are_token_exact_against_eager():
    hf = tiny_llama(6, 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(num_kv_blocks=256, block_size=16, max_num_seqs=20)
    eager = LLM.from_engine(engine(hf, enforce_eager=True, **kw)).generate(prompts(19), params, use_tqdm=False)
    graphed_engine = engine(hf, enforce_eager=False, **kw)
    graphed = LLM.from_engine(graphed_engine).generate(prompts(19), params, use_tqdm=False)
    assert graphed_engine.runner.graphs is not None and graphed_engine.runner.graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


def test_memory_profiling_sizes_the_kv_cache():
    hf = tiny_llama(4, 2)
    e = engine(hf, gpu_memory_utilization=0.5, max_model_len=256)
    free, total = torch.cuda.mem_get_info()
    assert e.kv_sizing.num_blocks > 0 and e.kv_sizing.num_bytes <= 0.5 * total
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        engine(hf, gpu_memory_utilization=1e-9, max_model_len=256)


def test_seeded_sampling_repeats_on_cuda():
    hf = tiny_llama(4, 2)
    llm = LLM.from_engine(engine(hf, num_kv_blocks=128))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts(3, seed=1), params, use_tqdm=False)
    again = llm.generate(prompts(3, seed=1)[:1], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert len(set(first[0].outputs[0].token_ids)) > 1
