"""KV sizing: blocks from bytes, from a memory fraction (minus weights and activations), or a count."""

import pytest

from octavo.config import CacheConfig, ModelConfig, RopeConfig, SchedulerConfig
from octavo.memory import GiB, activation_bytes, size_kv_cache

SMOL = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=100000.0), max_position=8192,
)


def test_embedded_model_costs_46080_bytes_per_token_in_float32():
    assert SMOL.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080


def test_blocks_from_bytes_round_down_and_concurrency():
    sched = SchedulerConfig(max_model_len=1000)
    sizing = size_kv_cache(CacheConfig(block_size=16, kv_cache_memory=GiB), sched, SMOL, 0, 4, "cpu")
    assert sizing.bytes_per_block == 16 * 46080
    assert sizing.num_blocks == GiB // (16 * 46080) == 1456
    assert sizing.num_tokens == 1456 * 16
    assert sizing.max_concurrency == pytest.approx(1456 / 63)  # 1000 tokens need 63 blocks of 16
    assert "1456 blocks x 16 tokens" in sizing.describe() and "max concurrency" in sizing.describe()


def test_memory_fraction_subtracts_weights_and_activations(monkeypatch):
    monkeypatch.setattr("octavo.memory.total_device_memory", lambda device: 10 * GiB)
    sched = SchedulerConfig()
    weights = 600 << 20
    sizing = size_kv_cache(CacheConfig(memory_fraction=0.5), sched, SMOL, weights, 4, "cpu")
    expected = (5 * GiB - weights - activation_bytes(SMOL, sched, 4)) // (16 * 46080)
    assert sizing.num_blocks == expected


def test_explicit_block_count_wins_and_too_little_memory_is_an_error():
    sched = SchedulerConfig()
    assert size_kv_cache(CacheConfig(num_blocks=7, kv_cache_memory=GiB), sched, SMOL, 0, 4, "cpu").num_blocks == 7
    with pytest.raises(ValueError, match="no room for the KV cache"):
        size_kv_cache(CacheConfig(kv_cache_memory=1000), sched, SMOL, 0, 4, "cpu")
