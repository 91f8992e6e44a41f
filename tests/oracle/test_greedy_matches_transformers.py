"""The oracle: Octavo's greedy tokens equal transformers' on the embedded model, in every mode.

The reference loads the GGUF through transformers' own dequantiser. Octavo runs the file's own
Q4_1 / Q8_0 blocks through its quantized kernels (the default), and once with every weight
dequantized to float32, so this checks the GGUF loading both ways (the blocks, the rotary row
order of q/k) and the kernels.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from octavo.models.loader import default_gguf_path
from octavo.sampling.params import SamplingParams
from tests.oracle.reference import (
    NUM_NEW_TOKENS,
    cached_greedy,
    compare,
    oracle_prompts,
    shared_prefix_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(smol):
    return smol[1]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return oracle_prompts(tokenizer)


@pytest.fixture(scope="module")
def refs(request, prompts):
    return cached_greedy(lambda: request.getfixturevalue("hf_smol"), default_gguf_path(), prompts)


@pytest.fixture(scope="module")
def shared_prompts(tokenizer):
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def shared_refs(request, shared_prompts):
    return cached_greedy(lambda: request.getfixturevalue("hf_smol"), default_gguf_path(), shared_prompts)


def check_all(outputs, refs, mode: str) -> None:
    failures, notes = [], []
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        ok, note = compare(out.outputs[0].token_ids, ref)
        (notes if ok else failures).append(f"[{mode}] prompt {i}: {note}") if note else None
    for note in notes:
        warnings.warn(note)
    assert not failures, "\n".join(failures)


def test_prompt_lengths_span_5_to_600(prompts):
    assert len(prompts) >= 8 and min(map(len, prompts)) == 5 and max(map(len, prompts)) == 600


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_all_in_one_batch(make_llm, prompts, refs, backend):
    """Both attention kernels: the default (the C++ one where it builds) and the torch reference."""
    llm = make_llm(attention_backend=backend)
    if backend == "reference":
        assert llm.engine.runner.attention_backend == "reference"
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, f"one batch, {llm.engine.runner.attention_backend} attention")
    # everything was admitted at once: the first step computed every prompt
    assert llm.engine.get_stats().num_prompt_tokens_total == sum(map(len, prompts))


def test_dense_weights_with_chunked_prefill(make_llm, prompts, refs):
    """--quantization none: every weight dequantized to float32 up front (oneDNN linear layers)."""
    llm = make_llm(weights="dense", max_num_batched_tokens=64)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch.float32
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, "dense float32 weights, budget 64")


def test_chunked_prefill_mixed_with_decodes(make_llm, prompts, refs):
    llm = make_llm(max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, "budget 32")


def test_preemption_by_recompute(make_llm, prompts, refs):
    # 48 blocks of 16 = 768 tokens: the longest request (664) fits alone, all of them never do;
    # vLLM's rules (the newest is the victim; admission takes any free block)
    llm = make_llm(num_kv_blocks=48, enable_prefix_caching=False, preemption_victim="newest", admission_headroom_steps=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.get_stats().scheduler.preemption.num_preemptions > 0
    check_all(outs, refs, "preemption")


def test_preemption_with_prefix_caching_resumes_from_own_prefix(make_llm, prompts, refs):
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=128)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.prefix.num_hits_tokens > 0
    check_all(outs, refs, "preemption+cache")


def test_priority_policy_preempting_scheduled_requests_with_caching(make_llm, prompts, refs):
    # Priority preemption can pick a victim that was already scheduled earlier in the same step
    # (the lowest priority need not be the newest). Its blocks must not stay hashed: a tiny pool,
    # mixed priorities (later prompts more urgent) and a small budget make that happen.
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=96, scheduling_policy="priority")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[len(prompts) - i for i in range(len(prompts))])
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.prefix.num_hits_tokens > 0
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs, refs, "priority preemption+cache")


def test_cache_aware_policy_on_a_tiny_pool(make_llm, prompts, refs, shared_prompts, shared_refs):
    """Cache-aware admission (a wait bound of 2 steps passed over, so the bound's path runs too),
    the cheapest victims, admission without headroom so that requests are preempted: the shared
    prompts' and the oracle prompts' tokens, in one batch, equal transformers'."""
    victim = "cheapest"
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=96, scheduling_policy="cache-aware", max_wait_steps=2,
                   preemption_victim=victim, admission_headroom_steps=0)
    outs = llm.generate(shared_prompts + prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.prefix.num_hits_tokens >= 7 * 304, stats
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs[: len(shared_prompts)], shared_refs, f"cache-aware, {victim} victim, shared prefixes")
    check_all(outs[len(shared_prompts) :], refs, f"cache-aware, {victim} victim")


def test_a_pinned_prefix_survives_a_flood_and_keeps_tokens(make_llm, shared_prompts, shared_refs):
    """The shared prompts' 300-token prefix pinned (18 full blocks of a 32-block pool), then a
    flood of unique prompts 10x the pool: every shared prompt still hits the whole pinned prefix,
    and its tokens equal transformers'."""
    llm = make_llm(num_kv_blocks=32, max_num_batched_tokens=256, pinned_prefix_share=0.6)
    assert llm.pin_prefix(shared_prompts[0][:300]) == (288, 18)
    flood = [[(7919 * i + 31 * j) % 40000 + 100 for j in range(160)] for i in range(32)]  # 32 x 10 blocks
    llm.generate(flood, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    kv = llm.engine.scheduler.kv_cache
    assert kv.pins.num_blocks == 18 and kv.view().check_invariants() == []
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in shared_prompts]
    assert all(o.num_cached_tokens >= 288 for o in outs), [o.num_cached_tokens for o in outs]
    check_all(outs, shared_refs, "pinned prefix after a flood")


@pytest.mark.parametrize("caching", [True, False])
def test_shared_prefixes(make_llm, shared_prompts, shared_refs, caching):
    llm = make_llm(enable_prefix_caching=caching, max_num_batched_tokens=512)
    outs = llm.generate(shared_prompts, GREEDY, use_tqdm=False)
    hits = llm.engine.get_stats().scheduler.prefix.num_hits_tokens
    if caching:
        assert hits >= 7 * 304  # every prompt after the first reuses at least the 300-token prefix's 19 blocks
        assert any(o.num_cached_tokens > 0 for o in outs)
    else:
        assert hits == 0
    check_all(outs, shared_refs, f"shared prefix, caching={caching}")


@pytest.mark.parametrize("budget", [2048, 32])
def test_block_size_8(make_llm, prompts, refs, budget):
    llm = make_llm(block_size=8, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, f"block 8, budget {budget}")


def test_parallel_greedy_samples_share_prompt_and_copy_on_write(make_llm, prompts, refs):
    # n=3 greedy: three sequences fork off one prompt (77 tokens: a partly filled last block that
    # all three share, then copy on their first diverging write); each must equal the reference.
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=3)
    (out,) = llm.generate([prompts[3]], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        ok, note = compare(completion.token_ids, refs[3])
        assert ok, note
    assert llm.engine.scheduler.kv_cache.num_free_blocks == llm.engine.scheduler.kv_cache.num_blocks


@pytest.mark.parametrize("medium", ["disk", "host"])
def test_second_kv_tier_serves_evicted_prefixes_and_swapped_requests(make_llm, shared_prompts, shared_refs,
                                                                      prompts, refs, tmp_path, medium):
    """A pool of 48 blocks (768 tokens) and a second tier on disk or in host memory: the shared
    prompts' prefixes are evicted between the two passes and come back from the tier; the oracle
    prompts together overflow the pool, so requests are preempted and resume through the tier,
    loading their blocks while others run. Same tokens."""
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=128, kv_offload_size=256 << 20, kv_offload_path=str(tmp_path),
                   kv_offload_medium=medium)
    for rnd in range(2):
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in shared_prompts]
        check_all(outs, shared_refs, f"tier, shared prefix pass {rnd}")
    stats = llm.engine.get_stats().scheduler
    assert stats.tier.num_loaded >= 8 and stats.prefix.num_tier_hits_tokens >= 8 * 16, stats  # the second pass' group prefixes
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, "tier, preemption")
    after = llm.engine.get_stats().scheduler
    assert after.preemption.num_preemptions > 0 and after.tier.num_loaded > stats.tier.num_loaded, after
    assert after.tier.num_corrupt == 0 and llm.engine.scheduler.kv_cache.view().check_invariants() == []
    llm.close()


def test_second_kv_tier_is_found_again_after_a_restart_and_refused_under_another_setting(
        make_llm, shared_prompts, shared_refs, tmp_path, caplog):
    """The tier's blocks outlive the engine: a second engine on the same folder serves the first
    one's prefix from it (the pool starts empty); an engine with another block size wipes it."""
    first = make_llm(num_kv_blocks=64, kv_offload_size=64 << 20, kv_offload_path=str(tmp_path))
    check_all([first.generate([shared_prompts[0]], GREEDY, use_tqdm=False)[0]], shared_refs[:1], "before restart")
    first.close()  # writes the pool's cached blocks the tier lacks
    second = make_llm(num_kv_blocks=64, kv_offload_size=64 << 20, kv_offload_path=str(tmp_path))
    out = second.generate([shared_prompts[1]], GREEDY, use_tqdm=False)[0]
    check_all([out], shared_refs[1:2], "after restart")
    assert out.num_cached_tokens >= 304 and second.engine.get_stats().scheduler.prefix.num_tier_hits_tokens >= 304
    second.close()
    other = make_llm(num_kv_blocks=128, block_size=8, kv_offload_size=64 << 20, kv_offload_path=str(tmp_path))
    assert "written by another model or setting (differs in: block_size, slot_bytes)" in caplog.text
    out = other.generate([shared_prompts[1]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and other.engine.get_stats().scheduler.prefix.num_tier_hits_tokens == 0
    check_all([out], shared_refs[1:2], "another block size")
    other.close()


def spec_stats(llm):
    s = llm.engine.get_stats().spec
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculative_decoding_in_one_batch(make_llm, prompts, refs, method, smol_dir):
    """Drafts verified for all eight requests in one step (max_batch above the batch): each keeps
    only the drafts its own next token agrees with; the tokens equal transformers'. The draft
    model is the embedded model itself (its own copy and KV cache): every greedy draft is kept."""
    extra = dict(speculative_model=str(smol_dir)) if method == "draft" else {}
    llm = make_llm(speculative_method=method, num_speculative_tokens=4, speculative_max_batch=16, **extra)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    drafts, drafted, accepted = spec_stats(llm)
    if method == "draft":
        assert drafts > 0 and accepted == drafted, (drafts, drafted, accepted)
    else:
        assert drafts > 0 and 0 < accepted < drafted, (drafts, drafted, accepted)  # some kept, some rejected
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs, refs, f"speculative {method}, one batch")


def test_speculative_decoding_with_chunks_preemption_and_prefix_caching(make_llm, prompts, refs, shared_prompts, shared_refs):
    """A 48-block pool, a 32-token budget (drafts count in it), prefix caching and preemption:
    rejected drafts' slots are given back and never published to the cache."""
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=32, speculative_method="ngram", speculative_max_batch=16,
                   admission_headroom_steps=0)
    outs = llm.generate(shared_prompts + prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.prefix.num_hits_tokens > 0 and spec_stats(llm)[2] > 0, stats
    assert llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs[: len(shared_prompts)], shared_refs, "speculative, shared prefixes, tiny pool")
    check_all(outs[len(shared_prompts) :], refs, "speculative, preemption")


def test_speculative_decoding_with_parallel_samples_and_block_8(make_llm, prompts, refs):
    """n = 3 greedy sequences forked off one prompt each verify their own drafts (blocks of 8)."""
    llm = make_llm(block_size=8, speculative_method="ngram", speculative_max_batch=16)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=3)
    (out,) = llm.generate([prompts[3]], params, use_tqdm=False)
    assert spec_stats(llm)[2] > 0
    for completion in out.outputs:
        ok, note = compare(completion.token_ids, refs[3])
        assert ok, note
    kv = llm.engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.view().check_invariants() == []


def test_speculative_decoding_with_the_second_kv_tier(make_llm, prompts, refs, tmp_path):
    """A 48-block pool with a host-memory tier: requests preempted while verifying drafts swap
    through the tier and resume; their blocks are cached only up to the tokens kept."""
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=128, kv_offload_size=256 << 20, kv_offload_medium="host",
                   speculative_method="ngram", speculative_max_batch=16, admission_headroom_steps=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.tier.num_stored > 0 and spec_stats(llm)[2] > 0, stats
    assert stats.tier.num_corrupt == 0 and llm.engine.scheduler.kv_cache.view().check_invariants() == []
    check_all(outs, refs, "speculative, second tier")
    llm.close()


def test_kv_events_follow_the_cache_through_evictions_preemption_and_the_tier(make_llm, shared_prompts, shared_refs,
                                                                            prompts, refs, tmp_path):
    """KV events on, blocks hashed as canonical CBOR, a small pool and a disk tier: the tokens are
    the oracle's, and an independent subscriber (tests/kv_events_subscriber.py) that restarts half
    way and catches up through the replay socket ends holding exactly the pool's hash map and the
    tier's ready entries, with no sequence gap; every pool block's hash recomputes from its tokens."""
    from tests.kv_events_subscriber import Subscriber

    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    conf = ('{"enable_kv_cache_events": true, "endpoint": "%s", "replay_endpoint": "%s", "hash_format": "bytes", '
            '"topic": "kv"}' % (pub, replay))
    llm = make_llm(num_kv_blocks=48, max_num_batched_tokens=128, kv_offload_size=256 << 20, kv_offload_path=str(tmp_path),
                   kv_offload_medium="disk", prefix_caching_hash_algo="sha256_cbor", kv_events_config=conf)
    sub = Subscriber(pub, replay, b"kv")
    sub.start(catch_up=True)  # the replay holds what was published before the SUB connected
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in shared_prompts]
    check_all(outs, shared_refs, "events, shared prefix pass")
    sub.stop()  # a subscriber restart: what is published meanwhile comes back through the replay
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in shared_prompts]
    check_all(outs, shared_refs, "events, shared prefix pass while the subscriber is down")
    sub.start(catch_up=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check_all(outs, refs, "events, preemption")
    kv = llm.engine.scheduler.kv_cache
    stats = llm.engine.get_stats().scheduler
    assert stats.preemption.num_preemptions > 0 and stats.tier.num_loaded > 0, stats
    num_batches = llm.engine.kv_events.num_batches
    sub.wait_for(lambda s: s.last_seq == num_batches - 1, what=f"batch {num_batches - 1}")
    pool = {("GPU", g, h) for g, h in kv.pool.cached}
    tier = {("DISK", g, h) for g, h in kv.tier.ready_keys()}
    assert sub.index == pool | tier, (len(sub.index - pool - tier), len((pool | tier) - sub.index))
    assert sub.num_gaps == 0 and sub.bad_hashes == [] and sub.num_checked >= len(pool)
    sub.stop()
    llm.close()
