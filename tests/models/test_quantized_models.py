"""Quantized weights end to end: the embedded GGUF loads as its own Q4_1 / Q8_0 blocks; a GGUF
with mixed formats (parts of a fused layer in different types, F32, Q4_0) loads as exactly the
model its dequantized tensors define; int8 / int4 quantization at load computes the model whose
weights are the quantize-then-dequantize of the float ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.config import CacheConfig
from octavo.kernels import cpu
from octavo.model_runner import ModelRunner
from octavo.models.layers import QuantEmbedding, QuantLinear
from octavo.models.loader import (
    GGUF_BLOCKS_FILE,
    describe_weights,
    gguf_source,
    load_gguf_weights,
    load_model,
    weight_bytes,
)
from octavo.quantization import Q4_0, Q4_1, Q8_0, dequantize, quantize
from tests.models.test_tiny_models import entry, hf_configs, run


def test_embedded_model_keeps_the_gguf_blocks(smol_dir, smol):
    model, _, nbytes = smol
    kinds = {(type(m).__name__, m.fmt.name) for m in model.modules() if isinstance(m, QuantLinear)}
    assert kinds == {("QuantLinear", "Q4_1"), ("QuantEmbedding", "Q8_0")}
    assert sum(isinstance(m, QuantLinear) and not isinstance(m, QuantEmbedding) for m in model.modules()) == 30 * 4
    assert model.lm_head is None  # tied: the Q8_0 embedding is also the head
    assert 90e6 < nbytes == weight_bytes(model) < 100e6  # the file's 97 MB, not 538 MB of float32
    line = describe_weights(model)
    assert "120 x Q4_1" in line and "1 x Q8_0" in line
    if cpu.load() is not None:
        assert f"octavo-cpu/{cpu.quant_isa()}" in line
    assert gguf_source(smol_dir) is not None and (smol_dir / GGUF_BLOCKS_FILE).is_file()


def test_quantization_none_is_dense_and_auto_on_hf_weights_is_dense(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_configs()["qwen2"], dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    for q in ("auto", "none"):
        model, _ = load_model(tmp_path, quantization=q)
        assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tmp_path, quantization="int3")


def _quantized_reference(hf, fmt):
    """transformers' model with every weight Octavo quantizes replaced by its dequantized blocks."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize(quantize(module.weight, fmt), fmt, module.in_features))
        emb = hf.get_input_embeddings()
        emb.weight.copy_(dequantize(quantize(emb.weight, Q8_0), Q8_0, emb.embedding_dim))
        if not hf.config.tie_word_embeddings:
            head = hf.lm_head
            head.weight.copy_(dequantize(quantize(head.weight, fmt), fmt, head.in_features))
    return hf


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama3-rope", "llama-mha-bias", "qwen2", "qwen3"])
def test_quantized_at_load_computes_the_dequantized_model(tmp_path, arch, scheme):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_configs()[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(tmp_path, quantization=scheme)
    fmt = {"int8": Q8_0, "int4": Q4_1}[scheme]
    assert {m.fmt for m in model.modules() if isinstance(m, QuantLinear) and not isinstance(m, QuantEmbedding)} == {fmt}
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.fmt is Q8_0
    ref = _quantized_reference(hf, fmt)
    runner = ModelRunner(model, cfg, CacheConfig(block_size=4, num_blocks=16), eos_token_ids=())
    a = torch.randint(0, 97, (9,)).tolist()
    with torch.no_grad():
        expect = ref(torch.tensor([a])).logits[0]
    out = run(runner, [entry("a", a[:5], 0, [3, 1])])
    torch.testing.assert_close(out["a"], expect[:5], atol=5e-5, rtol=0)
    out = run(runner, [entry("a", a[5:], 5, [3, 1, 6])])
    torch.testing.assert_close(out["a"], expect[5:], atol=5e-5, rtol=0)


# ---- a GGUF written here: every supported format, parts of one fused layer in different types ----

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 64, 96, 4, 2, 40
TYPES = {  # GGUF tensor -> format (None: F32)
    "token_embd.weight": Q8_0, "output_norm.weight": None, "output.weight": Q4_0,
    "blk.0.attn_norm.weight": None, "blk.0.ffn_norm.weight": None,
    "blk.0.attn_q.weight": Q4_1, "blk.0.attn_k.weight": Q8_0, "blk.0.attn_v.weight": Q4_1,  # mixed: parts
    "blk.0.attn_output.weight": Q4_0, "blk.0.ffn_gate.weight": Q4_0, "blk.0.ffn_up.weight": Q8_0,  # mixed: parts
    "blk.0.ffn_down.weight": None,
}
SHAPES = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
          "blk.0.attn_k.weight": (KV_HEADS * 16, HIDDEN), "blk.0.attn_v.weight": (KV_HEADS * 16, HIDDEN),
          "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (INTER, HIDDEN),
          "blk.0.ffn_up.weight": (INTER, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, INTER)}


def _write_gguf(path):
    import gguf

    from tests.models.gguf_writer import add_tiny_tokenizer

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    add_tiny_tokenizer(w, VOCAB, gemma=False)
    g = torch.Generator().manual_seed(7)
    dense = {}
    for name, fmt in TYPES.items():
        if fmt is None:
            shape = SHAPES.get(name, (HIDDEN,))
            data = (torch.randn(shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0)).numpy()
            w.add_tensor(name, data)
            dense[name] = torch.from_numpy(data.copy())
        else:
            q = quantize(torch.randn(SHAPES[name], generator=g) * 0.2, fmt)
            w.add_tensor(name, q.numpy(), raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType(fmt.gguf_type))
            dense[name] = dequantize(q, fmt, SHAPES[name][1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dense


def test_a_mixed_format_gguf_loads_as_its_dequantized_model(tmp_path):
    from octavo.config import ModelConfig, RopeConfig
    from octavo.models.llama import LlamaForCausalLM
    from octavo.models.gguf_arch import _unpermute_rope

    path = tmp_path / "mixed.gguf"
    dense = _write_gguf(path)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=16, rms_norm_eps=1e-5,
                      rope=RopeConfig(theta=10000.0), max_position=128, tie_word_embeddings=False)

    def fresh():
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        m = m.to_empty(device="cpu")
        m.rotary = m.rotary.__class__(cfg.rope, cfg.head_dim, cfg.max_position)
        return m

    quant = fresh()
    load_gguf_weights(quant, path)
    layer = quant.layers[0]
    # parts of one projection in different formats: each in its own blocks
    assert [p.fmt for p in layer.self_attn.qkv_proj.parts] == [Q4_1, Q8_0, Q4_1]
    assert layer.self_attn.o_proj.fmt is Q4_0
    assert [p.fmt for p in layer.mlp.gate_up_proj.parts] == [Q4_0, Q8_0]
    assert not isinstance(layer.mlp.down_proj, QuantLinear)  # F32 in the file
    assert quant.lm_head.fmt is Q4_0 and quant.embed_tokens.fmt is Q8_0

    ref = fresh()  # the same model from the dequantized tensors, all dense
    p = dict(ref.named_parameters())
    with torch.no_grad():
        p["embed_tokens.weight"].copy_(dense["token_embd.weight"])
        p["lm_head.weight"].copy_(dense["output.weight"])
        p["norm.weight"].copy_(dense["output_norm.weight"])
        p["layers.0.input_layernorm.weight"].copy_(dense["blk.0.attn_norm.weight"])
        p["layers.0.post_attention_layernorm.weight"].copy_(dense["blk.0.ffn_norm.weight"])
        q = torch.from_numpy(_unpermute_rope(dense["blk.0.attn_q.weight"].numpy(), HEADS))
        k = torch.from_numpy(_unpermute_rope(dense["blk.0.attn_k.weight"].numpy(), KV_HEADS))
        p["layers.0.self_attn.qkv_proj.weight"].copy_(torch.cat([q, k, dense["blk.0.attn_v.weight"]]))
        p["layers.0.self_attn.o_proj.weight"].copy_(dense["blk.0.attn_output.weight"])
        p["layers.0.mlp.gate_up_proj.weight"].copy_(torch.cat([dense["blk.0.ffn_gate.weight"], dense["blk.0.ffn_up.weight"]]))
        p["layers.0.mlp.down_proj.weight"].copy_(dense["blk.0.ffn_down.weight"])
    ids = torch.randint(0, VOCAB, (11,)).tolist()
    outs = []
    for model in (quant, ref):
        runner = ModelRunner(model, cfg, CacheConfig(block_size=4, num_blocks=8), eos_token_ids=())
        outs.append(run(runner, [entry("a", ids, 0, [2, 5, 1])])["a"])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
    assert np.isfinite(outs[0].numpy()).all()


def test_without_the_cpp_kernels_the_reference_path_computes_the_same(smol_dir, smol, monkeypatch):
    """Where the C++ kernels cannot be built, quantized layers keep the GGUF layout and every op
    runs the torch reference: same logits as the kernels' path."""
    from octavo.kernels import dispatch

    kernels_model, _, _ = smol
    monkeypatch.setattr(dispatch, "_cpu_kernels", lambda: False)
    ref_model, cfg = load_model(smol_dir, quantization="auto")
    assert {m.layout for m in ref_model.modules() if isinstance(m, QuantLinear)} == {"gguf"}
    ids = [(7 * i + 3) % 49152 for i in range(37)]
    outs = []
    for model, backend in ((ref_model, "reference"), (kernels_model, "auto")):
        if model is kernels_model:
            monkeypatch.undo()
        runner = ModelRunner(model, cfg, CacheConfig(block_size=16, num_blocks=4), eos_token_ids=(), attention_backend=backend)
        outs.append(run(runner, [entry("a", ids, 0, [1, 3, 0])])["a"])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-3, rtol=0)
    assert bool((outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() > 0.9)


def test_every_quantization_choice_has_a_meaning():
    from octavo.config import QUANTIZATION_CHOICES
    from octavo.quantization import HF_SCHEMES

    assert set(QUANTIZATION_CHOICES) == {"auto", "none", *HF_SCHEMES}
