"""The oracle on every model family Octavo reads from GGUF but has no real file of here (LFM2's
short-convolution state included: it lives in KV groups of its own, so every mode below covers it): a small
random-weight model written the way llama.cpp's converter writes the family
(tests/models/gguf_writer.py), loaded by Octavo from the file and by transformers from the same
dequantized weights. Greedy tokens must be equal in the five engine modes (one batch, a small
token budget, a tiny pool with preemption, prefix hits, n = 2), on prompts up to 150 tokens: past
Llama 3's scaling knee (64 in the small model)."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from octavo.sampling.params import SamplingParams
from tests.models.gguf_writer import hf_model, write_gguf
from tests.oracle.reference import compare, hf_greedy

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPT_LENGTHS = (5, 40, 100, 150)
# family -> (transformers model of tests/models/gguf_writer.py, GGUF architecture, tensor types the
# converter picks other than Q8_0: gpt-oss's experts are MXFP4 in every published file)
MXFP4_EXPERTS = {k: "MXFP4" for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
FAMILIES = {"llama3-rope-freqs": ("llama3", "llama", None), "llama-yarn": ("llama-yarn", "llama", None),
            "qwen3moe": ("qwen3moe", "qwen3moe", None), "qwen2moe": ("qwen2moe", "qwen2moe", None),
            "gemma2": ("gemma2", "gemma2", None), "phi3": ("phi3", "phi3", None),
            "gpt-oss": ("gpt-oss", "gpt-oss", MXFP4_EXPERTS), "lfm2": ("lfm2", "lfm2", None)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, GGUF path, the loaded model, its tokenizer, weight bytes, transformers' model)."""
    from octavo.models.loader import load_model, resolve_model, weight_bytes
    from octavo.tokenizer import load_tokenizer

    from gguf import GGMLQuantizationType

    hf_name, file_arch, types = FAMILIES[request.param]
    hf = hf_model(hf_name)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    write_gguf(hf, file_arch, path, {k: GGMLQuantizationType[v] for k, v in (types or {}).items()})
    model_dir = resolve_model(str(path))
    model, _ = load_model(model_dir, quantization="auto")
    return request.param, model_dir, model, load_tokenizer(model_dir), weight_bytes(model), hf


def build(family, **kwargs):
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.llm import LLM
    from octavo.models.registry import load_model_config

    _, model_dir, model, tokenizer, nbytes, _ = family
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("dtype", "float32")
    config = EngineArgs(**kwargs).to_config(load_model_config(model_dir))
    return LLM.from_engine(LLMEngine(config, model, tokenizer, nbytes))


def prompts(vocab: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def check(family, outs, asked: list[list[int]], mode: str, n: int = 1) -> None:
    name, *_, hf = family
    refs = hf_greedy(hf, asked, NUM_NEW)
    failures = []
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert len(out.outputs) == n
        for completion in out.outputs:
            ok, note = compare(list(completion.token_ids), ref)
            if not ok:
                failures.append(f"[{name}, {mode}] prompt {i} ({len(asked[i])} tokens): {note}")
            elif note:
                warnings.warn(f"[{name}, {mode}] prompt {i}: {note}")
    assert not failures, "\n".join(failures)


def test_one_batch_and_a_small_budget(family):
    asked = prompts(family[-1].config.vocab_size)
    check(family, build(family).generate(asked, GREEDY, use_tqdm=False), asked, "one batch")
    llm = build(family, max_num_batched_tokens=16)
    check(family, llm.generate(asked, GREEDY, use_tqdm=False), asked, "budget 16")


def test_a_tiny_pool_preempts_and_recomputes(family):
    asked = prompts(family[-1].config.vocab_size)
    # 12 blocks of 16 = 192 tokens: the longest request (166) fits alone; the three shorter ones are
    # admitted together and outgrow the pool as they decode. Every further KV group (a window of
    # 5 tokens, a short convolution's 3) holds 2 blocks per request more.
    groups = len(family[2].config.kv_groups())
    llm = build(family, num_kv_blocks=12 + 2 * (groups - 1), enable_prefix_caching=False, admission_headroom_steps=0)
    outs = llm.generate(asked, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
    check(family, outs, asked, "tiny pool")


def test_prefix_hits_and_n_2(family):
    asked = prompts(family[-1].config.vocab_size, shared=48)
    llm = build(family)
    check(family, llm.generate(asked, GREEDY, use_tqdm=False), asked, "shared prefix, cold")
    hits = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
    check(family, llm.generate(asked, GREEDY, use_tqdm=False), asked, "shared prefix, cached")
    assert llm.engine.get_stats().scheduler.prefix.num_hits_tokens - hits >= 48 * len(asked)
    two = SamplingParams(n=2, temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    check(family, build(family).generate(asked, two, use_tqdm=False), asked, "n = 2", n=2)


def test_speculation_and_the_second_tier(family, tmp_path):
    """Prompt-lookup drafts verified on each family, and a prefix served from the tier on disk by
    an engine started after the one that computed it: the same tokens as transformers'."""
    base = prompts(family[-1].config.vocab_size)
    asked = [p + p[: min(30, len(p))] for p in base]  # a repeated stretch: n-grams to draft from
    llm = build(family, speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    check(family, llm.generate(asked, GREEDY, use_tqdm=False), asked, "ngram speculation")
    assert llm.engine.get_stats().spec.num_drafts > 0
    first = build(family, kv_offload_size=64 << 20, kv_offload_path=str(tmp_path))
    first.generate([base[3]], GREEDY, use_tqdm=False)
    first.close()  # writes the pool's cached blocks the tier lacks
    second = build(family, kv_offload_size=64 << 20, kv_offload_path=str(tmp_path))
    (out,) = second.generate([base[3]], GREEDY, use_tqdm=False)
    stats = second.engine.get_stats().scheduler
    # a hit of all 9 whole blocks; a model whose every layer has a window loads only the blocks
    # its window reads from the tier (Phi-3 here: 6)
    assert stats.prefix.num_hits_tokens >= 144 and stats.prefix.num_tier_hits_tokens >= 96, stats
    assert stats.tier.num_corrupt == 0, stats
    check(family, [out], [base[3]], "prefix from the tier, after a restart")
    second.close()


def test_the_families_files_are_what_the_converter_writes(family):
    """The file carries what makes the family itself (not a plain Llama): Llama 3.1+'s rope_freqs,
    the experts and their routing rule (llama.cpp renormalises Qwen3-MoE's top-k weights, not
    Qwen2-MoE's, and writes no such key)."""
    from octavo.models.registry import load_model_config

    name, model_dir, *_ = family
    config = load_model_config(model_dir)
    if name == "llama3-rope-freqs":
        factors = config.rope.freq_factors
        assert factors is not None and factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0
        assert torch.isfinite(torch.tensor(factors)).all()
    if name == "llama-yarn":  # read from rope.scaling.*: the ramp's bounds and YaRN's attention factor
        rope = config.rope
        assert (rope.scaling_type, rope.factor, rope.original_max_position) == ("yarn", 4.0, 64)
        assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    if name == "gpt-oss":  # top-k then softmax, biases, sinks, the clamped SwiGLU, YaRN rounded as llama.cpp
        moe, model = config.moe, family[2]
        assert (moe.routing, moe.router_bias, moe.expert_bias, moe.top_k) == ("topk_softmax", True, True, 2)
        assert (config.hidden_act, config.swiglu_limit, config.attn_sinks, config.o_bias) == ("swiglu_oai", 7.0, True, True)
        assert config.layer_types == ("sliding", "full") * 2 and config.sliding_window == 5
        assert config.rope.scaling_type == "yarn" and config.rope.truncate
        assert torch.equal(model.layers[1].self_attn.sinks, family[-1].model.layers[1].self_attn.sinks)
        expert = model.layers[0].mlp.experts[3].gate_up_proj  # the file's MXFP4 blocks, 17 bytes per 32 weights
        assert expert.fmt.name == "MXFP4" and expert.qweight.numel() == 2 * 32 * 64 * 17 // 32
    if name == "lfm2":  # the short convolutions: which layers, the kernel, their own KV groups (a window of 3)
        assert config.layer_types == ("conv", "conv", "full", "conv", "full", "conv") and config.conv_kernel == 3
        assert [(g.kind, g.window, g.layers) for g in config.kv_groups()] == [
            ("attention", None, (2, 4)), ("conv", 3, (0, 1)), ("conv", 3, (3, 5))]
    if name.endswith("moe"):
        hf = family[-1].config
        moe = config.moe
        assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (8, 2, 32)
        assert moe.norm_topk_prob == (name == "qwen3moe") == hf.norm_topk_prob
        assert moe.shared_intermediate_size == (64 if name == "qwen2moe" else 0)
        from octavo.kernels import cpu

        if cpu.load() is not None:  # a decode step's experts run as one C++ call (kernels/cpu/moe.cpp)
            plain = type("Meta", (), {"prompt_rows": None})()
            assert family[2].layers[0].mlp._kernel(torch.zeros(1, config.hidden_size), plain) is not None


@pytest.mark.parametrize("option", [{"enable_lora": True}, {"tensor_parallel_size": 2}])
def test_lora_and_tensor_parallelism_on_experts_and_convolutions_are_refused_by_name(family, option):
    """Neither is built for a mixture of experts: asked for, the engine refuses before loading."""
    from octavo.engine_args import EngineArgs
    from octavo.engine_setup import load
    from octavo.models.loader import gguf_source
    from octavo.models.registry import load_model_config

    name, model_dir, *_ = family
    config = load_model_config(model_dir)
    args = EngineArgs(model=str(gguf_source(model_dir)), dtype="float32", **option)
    if config.moe is None and "conv" not in config.layer_types:
        args.check_model(config)  # a dense family has both
        return
    what = "LoRA adapters" if "enable_lora" in option else "tensor parallelism"
    kind = "a mixture-of-experts model" if config.moe is not None else "a model with short convolutions"
    with pytest.raises(ValueError, match=f"{what} .* on {kind} \\({config.architecture}\\)"):
        load(args)


def test_the_plan_of_each_file_holds_what_the_engine_holds(family):
    """`octavo plan FILE.gguf` counts the weights as the engine holds them (experts included), up to
    the kernels' row padding (the 97-row head packed in tiles of 16 rows: 1,020 bytes here)."""
    from octavo.models.gguf_file import read_header
    from octavo.models.loader import gguf_source, held_weight_bytes

    _, model_dir, _, _, nbytes, _ = family
    assert held_weight_bytes(read_header(gguf_source(model_dir))) == pytest.approx(nbytes, rel=0.015)


def test_int8_tokens_are_the_same_in_every_mode(family):
    """The int8 mode on every family (the prompts of 100 and 150 tokens through the AMX-BF16 prompt
    tiles where the CPU runs them; a MoE expert sees the choice for its own tokens): greedy tokens of
    one batch equal those of a small budget and of a tiny pool that preempts (not transformers':
    int8 is not exact, tests/oracle/test_int8_activations.py bounds its distance)."""
    from octavo.models.loader import load_model

    name, model_dir, _, tokenizer, nbytes, hf = family
    model, _ = load_model(model_dir, quantization="auto", activation_dtype="int8")
    int8 = (name, model_dir, model, tokenizer, nbytes, hf)
    asked = prompts(hf.config.vocab_size)
    base = [o.outputs[0].token_ids for o in build(int8).generate(asked, GREEDY, use_tqdm=False)]
    small = build(int8, max_num_batched_tokens=16).generate(asked, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in small] == base, name
    groups = len(model.config.kv_groups())
    llm = build(int8, num_kv_blocks=12 + 2 * (groups - 1), enable_prefix_caching=False, admission_headroom_steps=0)
    assert [o.outputs[0].token_ids for o in llm.generate(asked, GREEDY, use_tqdm=False)] == base, name
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
