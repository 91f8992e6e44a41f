"""LFM2 directories (transformers' `Lfm2ForCausalLM`): attention layers beside short convolutions
load as the same model, logits through the paged path in chunks and decodes, where a conv layer's
inputs take one K/V pair and where they take two; the config's feed-forward rule as transformers'."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CacheConfig
from octavo.model_runner import ModelRunner
from octavo.models.loader import load_model
from tests.models.test_tiny_models import entry, run


@pytest.mark.parametrize("kv_heads, slots", [(2, 1), (1, 2)])
def test_a_transformers_directory_loads_as_the_same_model(tmp_path, kv_heads, slots):
    from transformers import AutoModelForCausalLM, Lfm2Config

    cfg = Lfm2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=kv_heads, max_position_embeddings=256, conv_L_cache=3,
                     layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("conv.conv.weight"):
                p.normal_(0.0, 1.0)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.conv_slots() == slots and config.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features
    runner = ModelRunner(model.eval(), config, CacheConfig(block_size=4, num_blocks=128), eos_token_ids=())
    groups = len(config.kv_groups())
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = [3, 0, 7, 9]
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    out = run(runner, [entry("a", ids[:7], 0, blocks[:2], groups, stride=20)])["a"]
    torch.testing.assert_close(out, expect[:7], atol=5e-5, rtol=0)
    out = run(runner, [entry("a", ids[7:11], 7, blocks[:3], groups, stride=20)])["a"]  # a second chunk
    torch.testing.assert_close(out, expect[7:11], atol=5e-5, rtol=0)
    for pos in (11, 12):
        out = run(runner, [entry("a", [ids[pos]], pos, blocks[: pos // 4 + 1], groups, stride=20)])["a"]
        torch.testing.assert_close(out, expect[pos : pos + 1], atol=5e-5, rtol=0)


def test_conv_bias_is_refused_by_name():
    from octavo.models.registry import UnsupportedModelError, model_config_from_hf

    hf = {"architectures": ["Lfm2ForCausalLM"], "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "conv_bias": True,
          "layer_types": ["conv", "full_attention"]}
    with pytest.raises(UnsupportedModelError, match="conv_bias"):
        model_config_from_hf(hf)
