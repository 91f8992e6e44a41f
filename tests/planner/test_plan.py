"""octavo plan: bytes per token and concurrency computed by hand, for GQA and multi-head configs."""

import json
import subprocess
import sys

import pytest

from octavo.planner import estimate_num_params, make_plan, read_fields

SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True}
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
OPT = {"model_type": "opt", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, "ffn_dim": 4096,
       "vocab_size": 50272, "word_embed_proj_dim": 1024}


def test_grouped_query_bytes_per_token_and_concurrency_by_hand():
    f = read_fields(SMOL)
    assert (f.num_kv_heads, f.head_dim) == (3, 64) and f.used["num_kv_heads"] == "num_key_value_heads"
    plan = make_plan(f, device_memory=2**30, memory_fraction=1.0, kv_dtype="float16", weight_bytes=100 * 2**20,
                     block_size=16, typical_len=1000, max_len=4000)
    assert plan.bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert plan.bytes_per_block == 368640
    assert plan.kv_memory == 2**30 - 100 * 2**20 == 968884224
    assert plan.num_blocks == 2628  # 968884224 / 368640 = 2628.27
    assert plan.num_tokens == 42048
    assert plan.seqs_reserving_max == 10  # 4000 tokens = 250 blocks each
    assert plan.seqs_paged == 41  # 1000 tokens round up to 63 blocks (1008 slots) each
    assert plan.waste_paged == pytest.approx(8 / 1008)
    assert plan.waste_reserving_max == pytest.approx(0.75)
    assert plan.paged_over_reserved == pytest.approx(4.1)
    assert make_plan(f, 2**30, 1.0, "float32", 0).bytes_per_token == 46080  # the embedded model in fp32


def test_multi_head_gpt2_style_config_without_kv_head_field():
    f = read_fields(GPT2)
    assert (f.num_layers, f.hidden_size, f.num_heads, f.num_kv_heads, f.head_dim) == (12, 768, 12, 12, 64)
    assert "no KV-head field" in f.used["num_kv_heads"] and f.used["num_layers"] == "n_layer"
    assert f.used["head_dim"] == "n_embd / n_head"
    plan = make_plan(f, device_memory=16 * 2**30, memory_fraction=0.5, kv_dtype="float16", weight_bytes=2**30,
                     block_size=16, typical_len=100, max_len=1024)
    assert plan.bytes_per_token == 2 * 12 * 12 * 64 * 2 == 36864
    assert plan.num_blocks == (8 * 2**30 - 2**30) // (36864 * 16) == 12743
    assert plan.seqs_reserving_max == 12743 // 64 == 199
    assert plan.seqs_paged == 12743 // 7 == 1820  # 100 tokens -> 7 blocks of 16 (112 slots)
    # GPT-2 small has 124M parameters (position embeddings and biases are left out of the estimate)
    assert estimate_num_params(f) == pytest.approx(124e6, rel=0.03)


def test_opt_style_config_and_weight_estimate_used_when_not_given():
    f = read_fields(OPT)
    assert f.num_kv_heads == 16 and f.intermediate_size == 4096 and not f.gated_mlp
    plan = make_plan(f, device_memory=24 * 10**9, kv_dtype="float16")
    assert plan.weight_bytes_estimated and plan.weight_bytes == estimate_num_params(f) * 2
    assert estimate_num_params(f) == pytest.approx(350e6, rel=0.05)  # OPT-350m


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match="no layer count: looked for num_hidden_layers, n_layer, num_layers"):
        read_fields({"hidden_size": 8})
    with pytest.raises(ValueError, match="typical length"):
        make_plan(read_fields(SMOL), 2**30, typical_len=10, max_len=5)


def test_cli_prints_table_and_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", str(path), "--device-memory", "16GiB",
                          "--memory-fraction", "0.5", "--weight-bytes", "1GiB", "--typical-len", "100", "--kv-dtype", "float16",
                          "--max-len", "1024", "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["bytes_per_token"] == 36864 and data["seqs_paged"] == 1820
    table = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "KV bytes per token" in table and "paged / reserved" in table and "config fields used" in table


GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 18,
               "hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
               "intermediate_size": 2048, "vocab_size": 262144, "tie_word_embeddings": True,
               "sliding_window": 512, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]
               + ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]}


def test_a_sliding_window_model_holds_about_a_fifth_of_a_window_blind_cache_at_8k():
    """Gemma 3 270M: 15 of 18 layers attend within 512 tokens. At 8k tokens a sequence holds 512
    blocks per global layer and 33 per window layer: (3 x 512 + 15 x 33) / (18 x 512) = 22.0%."""
    from octavo.planner import window_aware_bytes

    f = read_fields(GEMMA3_270M)
    assert (f.sliding_window, f.num_window_layers) == (512, 15) and "layer_types" in f.used["num_window_layers"]
    per_layer_block = 2 * 1 * 256 * 2 * 16  # K and V, 1 KV head of 256, fp16, 16 tokens
    assert window_aware_bytes(f, 8192, 16, "float16") == (3 * 512 + 15 * 33) * per_layer_block
    assert window_aware_bytes(f, 100, 16, "float16") == 18 * 7 * per_layer_block  # inside the window: no saving
    plan = make_plan(f, device_memory=2**30, memory_fraction=1.0, kv_dtype="float16", weight_bytes=0, block_size=16)
    aware, blind = plan.seqs_by_context[8192]
    assert blind == 2**30 // (512 * 18 * per_layer_block) == 7
    assert aware == 2**30 // ((3 * 512 + 15 * 33) * per_layer_block) == 32
    assert plan.seqs_by_context[32768][0] / plan.seqs_by_context[32768][1] > 4


def test_window_layers_from_the_pattern_and_mistral_and_qwen_rules():
    pattern = {**GEMMA3_270M, "sliding_window_pattern": 6}
    del pattern["layer_types"]
    assert read_fields(pattern).num_window_layers == 15
    mistral = {**SMOL, "model_type": "mistral", "sliding_window": 4096}
    assert (read_fields(mistral).sliding_window, read_fields(mistral).num_window_layers) == (4096, 30)
    qwen_off = {**SMOL, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert read_fields(qwen_off).sliding_window is None and make_plan(read_fields(qwen_off), 2**30).seqs_by_context == {}
    qwen_on = {**qwen_off, "use_sliding_window": True, "max_window_layers": 20}
    assert read_fields(qwen_on).num_window_layers == 10


def test_plan_cli_prints_the_window_rows(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA3_270M))
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", str(path), "--device-memory", "1GiB",
                          "--memory-fraction", "1", "--weight-bytes", "0", "--kv-dtype", "float16"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "512 tokens on 15 of the layers" in out.stdout, out.stdout
    assert "32 keeping only window blocks, 7 window-blind (4.57x)" in out.stdout, out.stdout


@pytest.mark.parametrize("types", [
    ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    + ["sliding_attention"] * 5 + ["full_attention"],  # Gemma 3 270M: 1 global + 5 window groups of 3
    ["sliding_attention", "full_attention"] * 9,  # alternating (gpt-oss style): 1 + 1 of 9
    ["full_attention"] * 18,  # no window: one group of every layer
])
def test_the_plan_groups_layers_as_the_engine_does(types):
    """The plan's KV groups (and its per-group bytes) are the engine's: ModelConfig.kv_groups."""
    from octavo.models.registry import model_config_from_hf

    hf = {**GEMMA3_270M, "layer_types": types}
    engine = model_config_from_hf(hf).kv_groups()
    plan = make_plan(read_fields(hf), device_memory=2**30)
    by_kind = [(w, sum(g.window == w for g in engine), len(engine[0].layers)) for w in dict.fromkeys(g.window for g in engine)]
    assert plan.kv_groups == by_kind
    if len(engine) > 1:
        assert plan.bytes_per_token * by_kind[0][2] // 18 == 2 * by_kind[0][2] * 256 * 2  # K and V, fp16, per group



def test_plan_of_a_gguf_reads_its_tensor_bytes_as_held_and_the_serving_kv_dtype(smol):
    """`octavo plan FILE.gguf`: the weights the engine really holds (the file's blocks as packed,
    not parameters x the KV dtype's size from the config) and the KV dtype serve would use here."""
    import torch

    from octavo.models.loader import default_gguf_path

    _, _, held = smol  # the embedded model as the engine loads it
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", str(default_gguf_path()), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["weight_bytes"] == held and not data["weight_bytes_estimated"]
    assert data["kv_dtype"] == ("bfloat16" if torch.cuda.is_available() else "float16")  # kv_dtype_rule's auto
    assert data["bytes_per_token"] == 2 * 30 * 3 * 64 * 2


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "tie_word_embeddings": False}


def test_a_mixture_of_experts_plans_its_weights_total_and_read_per_step():
    """Qwen3-30B-A3B's published sizes (30.5B parameters, 3.3B active: Qwen3 technical report) from
    its config, and the bytes a step reads growing with the experts its tokens use."""
    f = read_fields(QWEN3_30B_A3B)
    assert (f.num_experts, f.experts_per_token, f.expert_intermediate_size) == (128, 8, 768)
    assert round(estimate_num_params(f) / 1e9, 1) == 30.5
    assert round(estimate_num_params(f, experts=8) / 1e9, 1) == 3.4  # 3.35B: the report rounds down
    plan = make_plan(f, device_memory=64 << 30, weight_bytes=17 << 30)
    assert plan.experts == (128, 8)
    per_step = plan.weight_bytes_per_step
    assert per_step[1] < per_step[4] < per_step[16] < per_step[64] < plan.weight_bytes
    # 16 tokens use 128 * (1 - (120 / 128) ** 16) = 82.4 experts of a layer on average
    dense = estimate_num_params(f, experts=0)
    share = (dense + (estimate_num_params(f) - dense) * 82.4 / 128) / estimate_num_params(f)
    assert per_step[16] == pytest.approx((17 << 30) * share, rel=1e-3)
    assert per_step[1] / plan.weight_bytes == pytest.approx(estimate_num_params(f, experts=8) / estimate_num_params(f))
    dense_plan = make_plan(read_fields(SMOL), device_memory=64 << 30)
    assert dense_plan.experts is None and dense_plan.weight_bytes_per_step == {}


def test_plan_sizes_from_what_serve_gives_on_this_machine(smol_dir):
    """Without --device-memory, `octavo plan` counts the blocks `octavo serve` allocates here (it
    assumed an 80 GiB GPU on a CPU machine: 2,041 sequences where serve gives 4 GiB)."""
    import torch

    from octavo.engine_args import EngineArgs
    from octavo.memory import size_kv_cache
    from octavo.models.loader import default_gguf_path
    from octavo.models.registry import load_model_config

    if torch.cuda.is_available():
        pytest.skip("serve's GPU sizing needs the step's measured activation peak")
    out = subprocess.run([sys.executable, "-m", "octavo.cli", "plan", str(default_gguf_path()), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    config = EngineArgs(dtype="float32").to_config(load_model_config(smol_dir))
    served = size_kv_cache(config.cache, config.scheduler, config.model_config, data["weight_bytes"],
                           config.cache.cache_dtype, "cpu")
    assert data["kv_dtype"] == config.cache.cache_dtype and data["num_blocks"] == served.num_blocks
    assert "what serve gives it on this CPU" in data["memory_source"]
