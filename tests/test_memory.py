"""KV sizing: blocks from bytes, from a memory fraction (minus weights and activations), or a count."""

import pytest

from octavo.config import CacheConfig, ModelConfig, RopeConfig, SchedulerConfig
from octavo.memory import GiB, activation_bytes, size_kv_cache

SMOL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0), max_position=8192,
)


def test_embedded_model_costs_46080_bytes_per_token_in_float32():
    assert SMOL.kv_bytes_per_token("float32") == 2 * 30 * 3 * 64 * 4 == 46080


def test_blocks_from_bytes_round_down_and_concurrency():
    sched = SchedulerConfig(max_model_len=1000)
    sizing = size_kv_cache(CacheConfig(block_size=16, kv_cache_memory=GiB), sched, SMOL, 0, "float32", "cpu")
    assert sizing.bytes_per_block == 16 * 46080
    assert sizing.num_blocks == GiB // (16 * 46080) == 1456
    assert sizing.num_tokens == 1456 * 16
    assert sizing.max_concurrency == pytest.approx(1456 / 63)  # 1000 tokens need 63 blocks of 16
    assert "1456 blocks x 16 tokens" in sizing.describe() and "max concurrency" in sizing.describe()


def test_gpu_memory_utilization_subtracts_weights_and_activations(monkeypatch):
    monkeypatch.setattr("octavo.memory.total_device_memory", lambda device: 10 * GiB)
    sched = SchedulerConfig()
    weights = 600 << 20
    sizing = size_kv_cache(CacheConfig(gpu_memory_utilization=0.5), sched, SMOL, weights, "float32", "cpu")
    expected = (5 * GiB - weights - activation_bytes(SMOL, sched, 4)) // (16 * 46080)
    assert sizing.num_blocks == expected


def test_explicit_block_count_wins_and_too_little_memory_is_an_error():
    sched = SchedulerConfig()
    assert size_kv_cache(CacheConfig(num_blocks=7, kv_cache_memory=GiB), sched, SMOL, 0, "float32", "cpu",
                         max_model_len_explicit=False).num_blocks == 7
    with pytest.raises(ValueError, match="no room for the KV cache"):
        size_kv_cache(CacheConfig(kv_cache_memory=1000), sched, SMOL, 0, "float32", "cpu")


def test_cuda_budget_uses_the_profiled_peak_and_graph_reserve(monkeypatch):
    monkeypatch.setattr("octavo.memory.total_device_memory", lambda device: 80 * GiB)
    sched = SchedulerConfig(max_model_len=4096)
    weights, peak, graphs = 16 * GiB, 3 * GiB, 512 << 20
    sizing = size_kv_cache(CacheConfig(), sched, SMOL, weights, "bfloat16", "cuda", activation_peak=peak, graph_bytes=graphs)
    assert sizing.num_blocks == (int(0.9 * 80 * GiB) - weights - peak - graphs) // (16 * SMOL.kv_bytes_per_token("bfloat16"))
    lower = size_kv_cache(CacheConfig(gpu_memory_utilization=0.5), sched, SMOL, weights, "bfloat16", "cuda", activation_peak=peak)
    assert lower.num_blocks == (40 * GiB - weights - peak) // (16 * SMOL.kv_bytes_per_token("bfloat16"))


def test_not_even_one_sequence_names_the_flags(monkeypatch):
    monkeypatch.setattr("octavo.memory.total_device_memory", lambda device: 20 * GiB)
    sched = SchedulerConfig(max_model_len=8192)
    # 0.9 x 20 GiB - 17.8 GiB of weights leave 0.2 GiB = 291 blocks; 8192 tokens need 512, 2048 need 128
    with pytest.raises(ValueError, match="not even one sequence of max_model_len 8192.*--gpu-memory-utilization.*--max-model-len"):
        size_kv_cache(CacheConfig(), sched, SMOL, int(17.8 * GiB), "float32", "cuda", activation_peak=0)
    ok = size_kv_cache(CacheConfig(), SchedulerConfig(max_model_len=2048), SMOL, int(17.8 * GiB), "float32", "cuda", activation_peak=0)
    assert ok.max_concurrency >= 1


def test_the_models_max_model_len_is_capped_to_the_pool_and_the_users_is_refused(monkeypatch):
    """A pool that cannot hold one sequence of the model's context (a 1B Llama file declares 131,072
    tokens): the model's max_model_len is capped to the longest that fits, said in the start-up
    line; one the user set is refused naming both numbers (vLLM refuses; llama.cpp's default
    context fits)."""
    sched = SchedulerConfig(max_model_len=8192)
    capped = size_kv_cache(CacheConfig(num_blocks=20), sched, SMOL, 0, "float32", "cpu", max_model_len_explicit=False)
    assert (capped.max_model_len, capped.capped_from, capped.blocks_per_seq) == (320, 8192, 20)
    assert capped.max_concurrency == 1.0
    assert "max_model_len capped to 320 from the model's 8192" in capped.describe()
    assert "--max-model-len" in capped.describe()
    with pytest.raises(ValueError, match=r"--max-model-len 8192 does not fit the KV cache: one sequence of it needs "
                                         r"512 blocks of 16 tokens, the cache holds 20 .*at most 320 fits"):
        size_kv_cache(CacheConfig(num_blocks=20), sched, SMOL, 0, "float32", "cpu")
    fits = size_kv_cache(CacheConfig(num_blocks=600), sched, SMOL, 0, "float32", "cpu", max_model_len_explicit=False)
    assert (fits.max_model_len, fits.capped_from) == (8192, None)
    monkeypatch.setattr("octavo.memory.total_device_memory", lambda device: 20 * GiB)
    gpu = size_kv_cache(CacheConfig(), sched, SMOL, int(17.8 * GiB), "float32", "cuda", activation_peak=0,
                        max_model_len_explicit=False)  # 291 blocks: the default is capped there too
    assert gpu.capped_from == 8192 and gpu.max_model_len == 291 * 16


def test_a_sliding_window_pool_caps_by_what_a_decoding_sequence_holds():
    from octavo.config import blocks_to_hold
    from octavo.memory import longest_fitting_len

    windows = (None, 512, 512, 512, 512, 512)  # Gemma 3: one global and five window groups
    longest = longest_fitting_len(windows, 400, 16, 32768)
    assert blocks_to_hold(windows, longest, 16, max_chunk=1) <= 400 < blocks_to_hold(windows, longest + 1, 16, max_chunk=1)
    assert longest_fitting_len(windows, 400, 16, 1000) == 1000


def test_an_engine_started_without_max_model_len_gets_the_pools(make_llm):
    llm = make_llm(kv_cache_memory=16 << 20)  # 22 blocks of the embedded model's 16 tokens
    assert llm.engine.config.scheduler.max_model_len == 22 * 16 == llm.engine.scheduler.config.max_model_len
    import pytest as _pytest

    with _pytest.raises(ValueError, match="--max-model-len 2048 does not fit"):
        make_llm(kv_cache_memory=16 << 20, max_model_len=2048)
