"""gpt-oss's pieces against their references: a transformers `GptOssForCausalLM` directory (experts
stacked x @ W with gate and up columns interleaved, the router named `router`, sinks) loads as the
same model (logits through the paged path, prefill then decode, past the 5-token window); the
routing rule and the clamped SwiGLU against transformers' own modules; MXFP4 safetensors refused
by name (MXFP4 blocks themselves: tests/kernels/test_k_quants.py)."""

from __future__ import annotations

import pytest
import torch

from octavo.config import CacheConfig
from octavo.kernels import reference
from octavo.model_runner import ModelRunner
from octavo.models.loader import load_model
from tests.models.gguf_writer import hf_model
from tests.models.test_tiny_models import entry, run


def test_a_transformers_directory_loads_as_the_same_model(tmp_path):
    hf = hf_model("gpt-oss")
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert (config.moe.routing, config.hidden_act, config.attn_sinks) == ("topk_softmax", "swiglu_oai", True)
    runner = ModelRunner(model.eval(), config, CacheConfig(block_size=4, num_blocks=96), eos_token_ids=())
    groups = len(config.kv_groups())
    assert groups == 2  # window and global layers
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = [3, 0, 7, 9, 10]
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    out = run(runner, [entry("a", ids[:11], 0, blocks[:3], groups)])["a"]
    torch.testing.assert_close(out, expect[:11], atol=5e-5, rtol=0)
    for pos in (11, 12):
        out = run(runner, [entry("a", [ids[pos]], pos, blocks[: pos // 4 + 1], groups)])["a"]
        torch.testing.assert_close(out, expect[pos : pos + 1], atol=5e-5, rtol=0)


def test_routing_and_the_clamped_swiglu_match_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    hf = hf_model("gpt-oss")
    router: GptOssTopKRouter = hf.model.layers[0].mlp.router
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    _, scores, indices = router(x)
    logits = torch.nn.functional.linear(x, router.weight, router.bias)
    weights, ids = reference.moe_route(logits, 2, True, "topk_softmax")
    assert torch.equal(ids, indices)
    torch.testing.assert_close(weights, scores)
    experts: GptOssExperts = hf.model.layers[0].mlp.experts
    gate_up = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * 10  # past the limit of 7
    interleaved = torch.stack([gate_up[:, :32], gate_up[:, 32:]], dim=-1).reshape(9, 64)
    ours = reference.swiglu_oai_and_mul(gate_up, experts.alpha, experts.limit)
    torch.testing.assert_close(ours, experts._apply_gate(interleaved))
    assert (gate_up.abs() > 7).any()


@pytest.mark.parametrize("leaf", ["gate_up_proj_blocks", "down_proj_scales"])
def test_mxfp4_safetensors_experts_are_refused_by_name(leaf):
    from octavo.models.loader import gpt_oss_tensors

    with pytest.raises(ValueError, match="MXFP4 safetensors are not supported; load the model's GGUF"):
        list(gpt_oss_tensors([(f"model.layers.0.mlp.experts.{leaf}", torch.zeros(2, 2))]))
