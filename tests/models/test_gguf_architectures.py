"""GGUF files of every architecture Octavo runs (llama, Llama 3.1+ with its `rope_freqs`, Mistral
written as llama, qwen2, qwen3, gemma2, gemma3, phi3, the mixtures of experts qwen2moe, qwen3moe and
gpt-oss), written the way llama.cpp's converter writes them
(tests/models/gguf_writer.py): each loads as the model transformers computes from the same
(dequantized) weights, logits equal through the paged path, prefill then decode, past Gemma's
sliding window and past Llama 3's scaling knee."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo.config import CacheConfig, RopeConfig
from octavo.model_runner import ModelRunner
from octavo.models import gguf_arch
from octavo.models.gguf_file import read_header
from octavo.models.layers import QuantLinear
from octavo.models.loader import _empty_model, load_gguf_weights
from octavo.models.registry import model_config_from_hf
from tests.models.gguf_writer import gguf, hf_model, write_gguf
from tests.models.test_tiny_models import entry, run


@pytest.mark.parametrize("arch, file_arch", [
    ("llama", "llama"), ("llama3", "llama"), ("llama-yarn", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
    ("gemma3", "gemma3"), ("gemma2", "gemma2"), ("phi3", "phi3"), ("qwen3moe", "qwen3moe"), ("qwen2moe", "qwen2moe"),
    ("gpt-oss", "gpt-oss"), ("lfm2", "lfm2"),
])
def test_gguf_of_each_architecture_loads_as_the_transformers_model(tmp_path, arch, file_arch):
    hf = hf_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf, file_arch, path)
    config = model_config_from_hf(gguf_arch.hf_config(read_header(path)))
    assert config.architecture == type(hf).__name__.replace("Mistral", "Llama")
    assert (config.rope.freq_factors is not None) == (arch == "llama3")
    if arch == "gemma3":
        assert config.layer_types == ("sliding",) * 5 + ("full",) and config.sliding_window == 5
    if arch == "gemma2":  # alternating layers, both soft-caps and the query scale (not in the file)
        assert config.layer_types == ("sliding", "full") * 2 and config.sliding_window == 5
        assert (config.attn_logit_softcap, config.final_logit_softcap, config.attention_scale) == (1.0, 30.0, 0.25)
    model = _empty_model(config, "cpu")
    load_gguf_weights(model, path)
    # q/k/v, o, gate/up, down per layer (per expert, and the shared expert's), and an untied head,
    # kept in their Q8_0 blocks; a router stays dense (F32 in the file)
    mlps = (hf.config.num_experts + bool(getattr(hf.config, "shared_expert_intermediate_size", 0))
            if config.moe else 1)
    expected = (2 + 2 * mlps) * hf.config.num_hidden_layers + (0 if hf.config.tie_word_embeddings else 1)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == expected
    runner = ModelRunner(model.eval(), config, CacheConfig(block_size=4, num_blocks=96), eos_token_ids=())
    groups = len(config.kv_groups())
    n = 90 if arch in ("llama3", "llama-yarn") else 13  # Llama 3, YaRN: past the original context (64); Gemma: the window
    ids = torch.randint(0, 97, (n,)).tolist()
    blocks = [3, 0, 7] + list(range(9, 9 + n // 4))
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    out = run(runner, [entry("a", ids[: n - 2], 0, blocks[: -(-(n - 2) // 4)], groups)])["a"]
    torch.testing.assert_close(out, expect[: n - 2], atol=5e-5, rtol=0)
    for pos in (n - 2, n - 1):  # decodes
        out = run(runner, [entry("a", [ids[pos]], pos, blocks[: pos // 4 + 1], groups)])["a"]
        torch.testing.assert_close(out, expect[pos : pos + 1], atol=5e-5, rtol=0)
    if arch in ("llama3", "llama-yarn"):  # the scaling matters: without it the late positions are another model's
        plain = dataclasses.replace(config, rope=RopeConfig(theta=config.rope.theta))
        model.rotary.rope = plain.rope
        model.rotary.reset_tables()
        out = run(runner, [entry("b", ids, 0, blocks[:-(-n // 4)], groups)])["b"]
        assert (out[64:] - expect[64:]).abs().max() > 20 * 5e-5


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_arch.UnsupportedGGUFError, match="'bert' is not supported; supported: llama, qwen2"):
        gguf_arch.hf_config(read_header(path))


@pytest.mark.parametrize("factors, message", [
    ([1.0] * 7, r"tensor rope_freqs.weight has shape \[7\]; the model's hyperparameters make it \[8\]"),
    ([1.0] * 7 + [-2.0], "rope_freqs.weight holds a value that is not a positive finite number"),
    ([1.0] * 7 + [float("nan")], "rope_freqs.weight holds a value that is not a positive finite number"),
])
def test_a_bad_rope_freqs_tensor_is_refused_by_name(tmp_path, factors, message):
    import numpy as np

    from tests.models import gguf_writer

    hf = hf_model("llama3")
    original = gguf_writer.llama3_rope_freqs
    gguf_writer.llama3_rope_freqs = lambda cfg, head_dim: np.array(factors, dtype=np.float32)
    try:
        write_gguf(hf, "llama", tmp_path / "bad.gguf")
    finally:
        gguf_writer.llama3_rope_freqs = original
    with pytest.raises(gguf_arch.GGUFFormatError, match=message):
        gguf_arch.hf_config(read_header(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("change, message", [
    ("used", "qwen3moe.expert_used_count 9 exceeds qwen3moe.expert_count 8"),
    ("count", "metadata qwen3moe.expert_count and qwen3moe.expert_used_count are required"),
    ("experts", r"tensor blk.0.ffn_gate_exps.weight has shape \[64, 32, 8\]; the model's hyperparameters make it "
                r"\[64, 32, 6\]"),
])
def test_a_mixture_of_experts_with_wrong_expert_metadata_is_refused_by_name(tmp_path, monkeypatch, change, message):
    hf = hf_model("qwen3moe")
    if change == "used":
        hf.config.num_experts_per_tok = 9
    elif change == "count":
        monkeypatch.setattr(gguf.GGUFWriter, "add_expert_count", lambda self, n: None)
    else:  # the metadata says 6 experts; the tensors stack 8
        original = gguf.GGUFWriter.add_expert_count
        monkeypatch.setattr(gguf.GGUFWriter, "add_expert_count", lambda self, n: original(self, 6))
    write_gguf(hf, "qwen3moe", tmp_path / "bad.gguf")
    with pytest.raises(gguf_arch.GGUFFormatError, match=message):
        gguf_arch.hf_config(read_header(tmp_path / "bad.gguf"))


def test_fused_parts_in_two_kernel_formats_stay_in_their_blocks(tmp_path):
    """A Llama 3 Q4_K_M file keeps q and k in one format and v in another on some layers: each part
    keeps its own blocks (QuantLinearParts), the logits still transformers'; `octavo plan`'s count
    of the weights held follows."""
    from octavo.models.layers import QuantLinearParts
    from octavo.models.loader import held_weight_bytes, weight_bytes

    hf = hf_model("llama")
    path = tmp_path / "mixed.gguf"
    write_gguf(hf, "llama", path, types={"attn_v": gguf.GGMLQuantizationType.Q4_1})
    config = model_config_from_hf(gguf_arch.hf_config(read_header(path)))
    model = _empty_model(config, "cpu")
    load_gguf_weights(model, path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinearParts) and [p.fmt.name for p in qkv.parts] == ["Q8_0", "Q8_0", "Q4_1"]
    assert qkv.bias is not None  # this Llama has attention biases: added after the parts
    runner = ModelRunner(model.eval(), config, CacheConfig(block_size=4, num_blocks=32), eos_token_ids=())
    ids = torch.randint(0, 97, (13,)).tolist()
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    out = run(runner, [entry("a", ids, 0, [3, 0, 7, 9], 1)])["a"]
    torch.testing.assert_close(out, expect, atol=5e-5, rtol=0)
    assert held_weight_bytes(read_header(path)) == pytest.approx(weight_bytes(model), rel=0.02)
