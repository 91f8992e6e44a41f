"""Tiny random-weight Llama (Llama 3 rope scaling), Mistral (with and without a sliding window),
Qwen2 (q/k/v bias), Qwen3 (q/k norm) and Gemma 3 (local and global layers, a window shorter than
the prompts) models: Octavo's logits through the paged path equal transformers' for prefill,
chunked prefill and decode."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CacheConfig
from octavo.kernels import cpu
from octavo.model_runner import ModelRunner
from octavo.models.loader import load_model
from octavo.outputs import SampleRow, ScheduledRequest
from octavo.sampling.params import SamplingParams

BS = 4
ATOL = 2e-5


def hf_configs():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    return {
        "llama3-rope": LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "llama-mha-bias": LlamaConfig(**{**common, "num_key_value_heads": 4}, attention_bias=True, tie_word_embeddings=True),
        "mistral": MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
        "mistral-window": MistralConfig(**common, sliding_window=5, tie_word_embeddings=False),
        # Gemma 3: a local layer then a global one, a 5-token window, a query scale of its own
        "gemma3": Gemma3TextConfig(
            **common, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=5,
            query_pre_attn_scalar=24, tie_word_embeddings=True,
        ),
    }


ARCHS = ["llama3-rope", "llama-mha-bias", "mistral", "qwen2", "qwen3", "mistral-window", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = hf_configs()[request.param]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random, non-trivial norms and biases so that every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, model_cfg = load_model(path)
    return request.param, hf, model, model_cfg


def entry(rid, tokens, start, block_ids, num_groups=1, stride=16):
    """A scheduled request; a model with several KV groups gets a table per group, group g's on
    block ids shifted by g x stride (above every id used), so groups never share a block."""
    tables = [[b + g * stride for b in block_ids] for g in range(num_groups)]
    return ScheduledRequest(rid, tokens, start, tables, SamplingParams(temperature=0), [SampleRow(rid)], [])


def run(runner, entries):
    """All-position logits of a step, in the order of `entries` (decodes are sorted first inside)."""
    ordered = sorted(entries, key=lambda e: e.num_tokens != 1)
    ids, pos, meta = runner.prepare(ordered)
    with torch.inference_mode():
        hidden = runner.model(ids, pos, runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden)
    out, offset = {}, 0
    for e in ordered:
        out[e.request_id] = logits[offset : offset + e.num_tokens]
        offset += e.num_tokens
    return out


def test_config_translation(pair):
    name, hf, _, cfg = pair
    assert cfg.num_layers == 2 and cfg.vocab_size == 97
    assert cfg.qk_norm == (name in ("qwen3", "gemma3"))
    assert cfg.layer_types == {"mistral-window": ("sliding", "sliding"), "gemma3": ("sliding", "full")}.get(name, ())
    assert cfg.sliding_window == (5 if name in ("mistral-window", "gemma3") else None)
    assert cfg.qkv_bias == (name in ("qwen2", "llama-mha-bias"))
    assert cfg.o_bias == (name == "llama-mha-bias")
    assert (cfg.rope.scaling_type == "llama3") == (name == "llama3-rope")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_paged_prefill_chunked_prefill_and_decode_match_transformers(pair, backend):
    _, hf, model, cfg = pair
    if backend == "cpu" and cpu.load() is None:
        pytest.skip("the C++ CPU kernel is not built on this machine (tests/kernels says why)")
    runner = ModelRunner(
        model, cfg, CacheConfig(block_size=BS, num_blocks=32), eos_token_ids=(), attention_backend=backend
    )
    assert runner.attention_backend == backend
    torch.manual_seed(1)
    a = torch.randint(0, 97, (11,)).tolist()
    b = torch.randint(0, 97, (7,)).tolist()
    tables = {"a": [5, 2, 9], "b": [0, 7, 3]}  # scattered, non-contiguous blocks
    with torch.no_grad():
        ref_a = hf(torch.tensor([a + [3]])).logits[0]
        ref_b = hf(torch.tensor([b + [4, 5]])).logits[0]

    # step 1: all of b and the first 6 tokens of a (a chunk)
    g = len(cfg.kv_groups())
    out = run(runner, [entry("a", a[:6], 0, tables["a"], g), entry("b", b, 0, tables["b"], g)])
    torch.testing.assert_close(out["a"], ref_a[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["b"], ref_b[:7], atol=ATOL, rtol=0)
    # step 2: the rest of a attends to its cached first chunk; b decodes one token
    out = run(runner, [entry("a", a[6:], 6, tables["a"], g), entry("b", [4], 7, tables["b"], g)])
    torch.testing.assert_close(out["a"], ref_a[6:11], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["b"], ref_b[7:8], atol=ATOL, rtol=0)
    # step 3: both decode, batched together (crossing a block boundary for a)
    out = run(runner, [entry("a", [3], 11, tables["a"], g), entry("b", [5], 8, tables["b"], g)])
    torch.testing.assert_close(out["a"], ref_a[11:12], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["b"], ref_b[8:9], atol=ATOL, rtol=0)


def test_the_profiling_step_goes_through_prepare_and_allocates_no_cache(pair, monkeypatch):
    """The worst-case step is synthetic requests fed through `prepare` (the one builder of a step's
    metadata) on a scratch cache; the runner's own cache comes later, from init_kv_cache."""
    _, _, model, cfg = pair
    runner = ModelRunner(model, cfg, CacheConfig(block_size=BS), eos_token_ids=(), max_num_seqs=4, max_model_len=24)
    seen = []
    real_prepare = runner.prepare
    monkeypatch.setattr(runner, "prepare", lambda entries: seen.append([e.num_tokens for e in entries]) or real_prepare(entries))
    assert runner.profile_activation_peak(max_num_batched_tokens=60, max_num_seqs=4) is None  # CPU: no allocator peak
    assert seen == [[24, 24, 12]] and runner.kv_caches == []
    runner.init_kv_cache(8)
    assert len(runner.kv_caches) == cfg.num_layers and runner.kv_caches[0][0].shape[0] == 8
    with pytest.raises(ValueError, match="already allocated"):
        runner.init_kv_cache(8)
