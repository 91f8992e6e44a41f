"""The engine with the Triton kernels (in the interpreter on the CPU) generates the same greedy
tokens as with the torch reference kernels, on tiny random Llamas (GQA 2 and 3), through
chunked prefill, prefix hits, decodes batched with chunks, preemption, and speculative steps
(a request's last token and its drafts beside other decodes)."""

from __future__ import annotations

import pytest
import torch

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.kernels import triton as octavo_triton
from octavo.llm import LLM
from octavo.models.loader import model_from_hf
from octavo.sampling.params import SamplingParams
from octavo.tokenizer import synthetic_tokenizer

pytestmark = pytest.mark.skipif(
    not (octavo_triton.can_run_on("cuda") or octavo_triton.can_run_on("cpu")), reason="triton cannot run here"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llama(num_heads: int, num_kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=16 * num_heads, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def generate(hf, tokenizer, backend: str, prompts, **engine_kwargs):
    model, model_config = model_from_hf(hf, torch.float32, DEVICE)
    args = EngineArgs(dtype="float32", device=DEVICE, attention_backend=backend, **engine_kwargs)
    engine = LLMEngine(args.to_config(model_config), model, tokenizer, 0)
    assert engine.runner.attention_backend == backend
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(o.metrics.num_preemptions for o in outs)


@pytest.mark.parametrize("num_heads, num_kv_heads, block_size, preempt", [(4, 2, 8, True), (6, 2, 16, False)])
def test_triton_backend_tokens_equal_reference(num_heads, num_kv_heads, block_size, preempt):
    hf = tiny_llama(num_heads, num_kv_heads)
    tokenizer = synthetic_tokenizer(97)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 97, (block_size + 3,), generator=g).tolist()
    prompts = [
        torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 7, 26)
    ] + [shared + [5, 6], shared + [7]]  # the second shares full blocks with the first
    kwargs = dict(block_size=block_size, max_num_batched_tokens=24, num_kv_blocks=64)
    expected, _ = generate(hf, tokenizer, "reference", prompts, **kwargs)
    assert generate(hf, tokenizer, "triton", prompts, **kwargs)[0] == expected
    if not preempt:
        return
    # a pool too small for all at once: requests are preempted and recomputed (admission without
    # headroom for the running requests, so that it fills the pool and preempts)
    tight = dict(block_size=block_size, max_num_batched_tokens=24, num_kv_blocks=(50 // block_size) + 2,
                 admission_headroom_steps=0)
    tokens, num_preemptions = generate(hf, tokenizer, "triton", prompts, **tight)
    assert tokens == expected and num_preemptions > 0


def test_triton_backend_refused_where_it_cannot_run(monkeypatch):
    from octavo.kernels import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="triton backend cannot run on cpu"):
            dispatch.select_attention_backend("triton", torch.device("cpu"), torch.float32)
    # auto never picks triton on the CPU
    assert dispatch.select_attention_backend("auto", torch.device("cpu"), torch.bfloat16, torch.bfloat16) == "reference"


def test_padded_decode_buffers_equal_the_plain_forward():
    """What a CUDA graph replays: the step copied into static buffers, padded to a captured size
    with rows of context 0 and slot -1. The real rows' hidden states equal the plain forward's, and
    the padding writes nothing into the KV cache."""
    from octavo.cuda_graphs import DecodeBuffers, graph_batch_sizes
    from octavo.outputs import SampleRow, ScheduledRequest

    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20] and graph_batch_sizes(3) == [1, 2, 3]
    hf = tiny_llama(4, 2)
    model, model_config = model_from_hf(hf, torch.float32, DEVICE)
    args = EngineArgs(dtype="float32", device=DEVICE, attention_backend="triton", num_kv_blocks=32, block_size=8)
    runner = LLMEngine(args.to_config(model_config), model, synthetic_tokenizer(97), 0).runner
    for layer in runner.kv_caches:  # a cache full of earlier keys: padding must not touch it
        layer[0].normal_()
        layer[1].normal_()
    entries = [
        ScheduledRequest(f"r{i}", [7 + i], start, [blocks], SamplingParams(temperature=0), [SampleRow(f"r{i}")], [])
        for i, (start, blocks) in enumerate([(5, [3]), (17, [4, 9, 2]), (0, [11])])
    ]
    ids, pos, meta = runner.prepare(entries)
    buffers = DecodeBuffers(graph_batch_sizes(8), max_blocks_per_seq=6, device=torch.device(DEVICE))
    assert buffers.fits(3, meta)
    size = buffers.fill(ids, pos, meta)
    assert size == 4
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    with torch.inference_mode():
        padded = model(buffers.input_ids[:size], buffers.positions[:size], runner.kv_caches, buffers.meta(size))
        after_padded = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        plain = model(ids, pos, runner.kv_caches, meta)
    torch.testing.assert_close(padded[:3], plain, atol=1e-6, rtol=1e-6)
    for (k, v), (k1, v1) in zip(runner.kv_caches, after_padded):
        assert torch.equal(k, k1) and torch.equal(v, v1)  # same writes, none from the padding row


def test_triton_backend_verifies_drafts_as_the_reference_does():
    """Speculative steps (a request's last token and its drafts: a multi-token span with decodes
    beside it) through the Triton kernels: the same tokens as plain decoding on the reference."""
    hf = tiny_llama(4, 2)
    tokenizer = synthetic_tokenizer(97)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() * 3 for n in (3, 5, 8)]  # repeats to draft from
    kwargs = dict(block_size=8, max_num_batched_tokens=24, num_kv_blocks=64)
    expected, _ = generate(hf, tokenizer, "reference", prompts, **kwargs)
    model, model_config = model_from_hf(hf, torch.float32, DEVICE)
    args = EngineArgs(dtype="float32", device=DEVICE, attention_backend="triton", speculative_method="ngram",
                      speculative_max_batch=8, prompt_lookup_min=1, **kwargs)
    engine = LLMEngine(args.to_config(model_config), model, tokenizer, 0)
    outs = LLM.from_engine(engine).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.get_stats().spec.num_drafts > 0
