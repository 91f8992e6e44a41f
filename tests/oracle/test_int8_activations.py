"""The second oracle: the int8-activation path (--activation-dtype int8) is not exact, so it is held
to stated tolerances instead of token-for-token equality.

1. Accuracy: over the committed evaluation text (octavo/bench/data/eval_text.txt), its next-token
   distributions against the exact float32 path's, which equals transformers' token for token
   (tests/oracle/test_greedy_matches_transformers.py) and is used here as transformers' stand-in:
   same top token on at least 94% of positions, mean KL divergence at most 0.006 nats, perplexity
   within 1%. Measured on this machine class: 96.9%, 0.0028, +0.04%; llama.cpp's own logits on
   the same file and tokens against the same exact ones: 96.6%, 0.0030, +0.6% (docs/BENCHMARKS.md).
   Where the CPU runs AMX-BF16 tiles, the prompt positions of prompts of 64+ tokens go through
   them (x and W rounded to bfloat16, float32 sums; kernels/row_paths.py):
   the bounds hold both with them (measured 98.2%, 0.0008, -0.07%) and without.
2. Every engine mode: chunked prefill, preemption, prefix caching, forks, blocks of 8, speculation
   and the second KV tier give the int8 path's greedy tokens of one plain batch, token for token.
   An int8 row's result does not depend on the rows beside it (activations quantized per row,
   every row through the same kernel at any batch size), and which kernel a token takes depends on
   its own request (prompt length, position), so no mode may change a token.
"""

from __future__ import annotations

import pytest

from octavo.bench.accuracy import DEFAULT_TEXT, Scorer, evaluate, text_tokens
from octavo.kernels import cpu, row_paths
from octavo.sampling.params import SamplingParams
from tests.oracle.reference import NUM_NEW_TOKENS, oracle_prompts, shared_prefix_prompts

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the int8 kernels are C++ CPU kernels: not built here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
MIN_SAME_TOP, MAX_MEAN_KL, MAX_PERPLEXITY_RATIO = 0.94, 0.006, 1.01


@pytest.mark.parametrize("prompt_tiles", [True, False], ids=["prompt tiles where they run", "int8 rows only"])
def test_int8_tracks_the_exact_path_within_the_stated_bounds(smol, smol_int8, smol_dir, prompt_tiles, monkeypatch):
    from octavo.models.registry import load_model_config

    if not prompt_tiles:
        monkeypatch.setattr(row_paths, "PROMPT_TILES_MIN_TOKENS", 1 << 30)
    elif not cpu.amx_bf16_enabled():
        pytest.skip("AMX-BF16 tiles do not run here: the int8 rows only case covers this machine")

    cfg = load_model_config(smol_dir)
    tokenizer = smol[1]
    scorers = {"float32": Scorer(smol[0], cfg, 512), "int8": Scorer(smol_int8[0], cfg, 512)}
    token_ids, bos = text_tokens(tokenizer, DEFAULT_TEXT.read_text())
    result = evaluate(scorers, token_ids, 512, bos=bos)
    exact, int8 = result.scores
    assert result.num_tokens >= 700
    assert exact.mean_kl == 0 and exact.same_top_token == 1
    assert int8.mean_kl > 0, "the int8 path computed the exact path's numbers: is it running at all?"
    assert int8.same_top_token >= MIN_SAME_TOP and int8.mean_kl <= MAX_MEAN_KL, int8
    assert int8.perplexity <= exact.perplexity * MAX_PERPLEXITY_RATIO, (int8, exact)


@pytest.fixture(scope="module")
def prompts(smol):
    return oracle_prompts(smol[1])


@pytest.fixture(scope="module")
def shared(smol):
    return shared_prefix_prompts(smol[1])


@pytest.fixture(scope="module")
def baseline(make_llm, prompts, shared):
    """The int8 path's greedy tokens, every prompt in one plain batch."""
    llm = make_llm(weights="int8")
    return [o.outputs[0].token_ids for o in llm.generate(prompts + shared, GREEDY, use_tqdm=False)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_int8_engine_is_int8_and_differs_from_the_exact_path(make_llm, prompts, baseline):
    llm = make_llm(weights="int8")
    assert llm.engine.runner.model.layers[0].mlp.down_proj.layout == "packed_i8"
    assert llm.engine.runner.prompt_tiles == cpu.amx_bf16_enabled()
    if llm.engine.runner.prompt_tiles:  # the oracle prompts reach the tiles' length
        assert max(len(p) for p in prompts) >= row_paths.PROMPT_TILES_MIN_TOKENS
    exact = tokens(make_llm().generate(prompts, GREEDY, use_tqdm=False))
    assert exact != baseline[: len(prompts)]  # 8 x 64 tokens: int8 rounding moves some of them


@pytest.mark.parametrize("mode,kwargs", [
    ("budget 32", dict(max_num_batched_tokens=32)),
    ("preemption", dict(num_kv_blocks=48, enable_prefix_caching=False, preemption_victim="newest",
                        admission_headroom_steps=0)),
    ("block 8", dict(block_size=8, max_num_batched_tokens=64)),
    ("speculative ngram", dict(speculative_method="ngram", speculative_max_batch=16)),
    ("tier + preemption", dict(num_kv_blocks=48, max_num_batched_tokens=128, kv_offload_size=256 << 20,
                               kv_offload_medium="host", admission_headroom_steps=0)),
])
def test_int8_greedy_tokens_are_the_same_in_every_mode(make_llm, prompts, shared, baseline, mode, kwargs):
    llm = make_llm(weights="int8", **kwargs)
    outs = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert outs == baseline[: len(prompts)], mode
    if mode.startswith("preemption") or mode.startswith("tier"):
        assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
    llm.close()


def test_int8_prefix_hits_and_forks_keep_the_tokens(make_llm, prompts, shared, baseline):
    llm = make_llm(weights="int8", max_num_batched_tokens=512)
    outs = tokens(llm.generate(shared, GREEDY, use_tqdm=False))
    assert llm.engine.get_stats().scheduler.prefix.num_hits_tokens >= 7 * 304
    assert outs == baseline[len(prompts) :]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=3)
    (out,) = llm.generate([prompts[3]], params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [baseline[3]] * 3


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_gemmas_q5_0_blocks_are_held_at_the_files_size(activations):
    """Gemma 3's file keeps q/k and gate/up in Q5_0 (v in Q8_0): both paths' kernels read Q5_0
    as it is (22 bytes per 32 weights; Q8_0 would take 34), q|k|v as parts in their own formats,
    so the weights held stay within 5% of the file's tensor bytes, as `octavo plan` predicts from
    the header alone."""
    from octavo.models.gguf_file import read_header
    from octavo.models.layers import QuantLinearParts
    from octavo.models.loader import describe_weights, held_weight_bytes, load_model, packaged_gguf
    from octavo.models.loader import resolve_model, weight_bytes

    gguf = packaged_gguf("gemma3-270m")
    model, _ = load_model(resolve_model(gguf), quantization="auto", activation_dtype=activations)
    assert "Q5_0" in describe_weights(model)
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantLinearParts) and [p.fmt.name for p in qkv.parts] == ["Q5_0", "Q5_0", "Q8_0"]
    header = read_header(gguf)
    file_bytes = sum(t.num_bytes for t in header.tensors.values())
    assert weight_bytes(model) <= 1.05 * file_bytes
    assert held_weight_bytes(header) == pytest.approx(weight_bytes(model), rel=0.01)


@pytest.mark.skipif(not cpu.amx_bf16_enabled(), reason="AMX-BF16 tiles do not run here")
def test_long_prompts_reach_the_tiles_and_short_ones_do_not(make_llm, prompts, monkeypatch):
    """The engine really routes rows: a prompt of PROMPT_TILES_MIN_TOKENS+ tokens calls the tiles'
    kernel with exactly its prompt rows (its answer's decode rows do not), a shorter prompt never."""
    rows_seen = []
    kernel = cpu.quant_linear_bf16_i8

    def counting(x, *a, **k):
        rows_seen.append(x.shape[0])
        return kernel(x, *a, **k)

    monkeypatch.setattr(cpu, "quant_linear_bf16_i8", counting)
    llm = make_llm(weights="int8")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    short = [p for p in prompts if len(p) < row_paths.PROMPT_TILES_MIN_TOKENS][0]
    llm.generate([short], params, use_tqdm=False)
    assert rows_seen == []
    long = [p for p in prompts if len(p) >= row_paths.PROMPT_TILES_MIN_TOKENS][0]
    llm.generate([long], params, use_tqdm=False)
    assert rows_seen and set(rows_seen) == {len(long)}  # every layer, the prompt's rows, one step


@pytest.fixture
def tiles_here(monkeypatch):
    """The prompt tiles on: the real kernel where AMX-BF16 runs; elsewhere a stand-in with the two
    properties that matter to the prefix cache (a row's result does not depend on the batch, and
    differs in bits from the int8 rows'): the int8 kernel over x rounded to bfloat16."""
    if not cpu.amx_bf16_enabled():
        int8 = cpu.quant_linear_i8
        monkeypatch.setattr(cpu, "amx_bf16_enabled", lambda: True)
        monkeypatch.setattr(cpu, "quant_linear_bf16_i8", lambda x, *a: int8(x.bfloat16().float(), *a))


def test_int8_prefix_hits_never_hand_a_prompt_kv_the_other_path_computed(make_llm, prompts, tiles_here):
    """A long prompt after a short one with the same start, and a conversation's second turn after
    its first, give the cold run's tokens and log-probabilities bit for bit: a block's hash says
    which path computed it (kv_cache/prefix_cache.block_extra_keys), so the int8 rows' KV (a short
    prompt's, an answer's) never serves positions the tiles compute."""
    T = row_paths.PROMPT_TILES_MIN_TOKENS
    long = next(p for p in prompts if len(p) >= T + 16)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm, prompt):
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return list(out.outputs[0].token_ids), [lp.logprob for lp in out.outputs[0].logprobs]

    def cold(prompt):
        llm = make_llm(weights="int8")
        assert llm.engine.runner.prompt_tiles
        try:
            return run(llm, prompt)
        finally:
            llm.close()

    want_long = cold(long)
    answer, _ = want_long
    turn2 = long + answer + long[:20]
    want_turn2 = cold(turn2)

    llm = make_llm(weights="int8")
    try:
        run(llm, long[: T - 8])  # its full blocks cached, computed by the int8 rows
        assert run(llm, long) == want_long
        hits_before = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
        assert run(llm, turn2) == want_turn2  # the first turn (long) is cached: prompt by tiles, answer by rows
        shared = llm.engine.get_stats().scheduler.prefix.num_hits_tokens - hits_before
        assert shared == len(long) // 16 * 16  # the blocks both computed as prompt, no more
    finally:
        llm.close()
