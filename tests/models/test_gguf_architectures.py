"""GGUF files of every architecture Octavo runs (llama, Mistral written as llama, qwen2, qwen3,
gemma3), written here with gguf-py the way llama.cpp's converter writes them (its tensor names, q/k
rows interleaved for llama, Gemma's norms stored as 1 + w, linear weights as Q8_0 blocks): each
loads as the model transformers computes from the same (dequantized) weights, logits equal
through the paged path, prefill then decode, past Gemma's sliding window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.config import CacheConfig
from octavo.model_runner import ModelRunner
from octavo.models import gguf_arch
from octavo.models.gguf_file import read_header
from octavo.models.layers import QuantLinear
from octavo.models.loader import _empty_model, load_gguf_weights
from octavo.models.registry import model_config_from_hf
from tests.models.test_tiny_models import entry, run

gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6)

# llama.cpp's tensor names (gguf-py's TENSOR_NAMES) for each checkpoint name, per layer
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def hf_model(arch: str):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config = {
        "llama": LlamaConfig(**COMMON, num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False),
        "mistral": MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False),
        # six layers: llama.cpp's Gemma 3 pattern (five local, one global) is not in the file
        "gemma3": Gemma3TextConfig(**COMMON, num_hidden_layers=6, head_dim=16, sliding_window=5,
                                   query_pre_attn_scalar=16, tie_word_embeddings=True),
    }[arch]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def _gguf_name(name: str, gemma: bool) -> str:
    if not name.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{(GEMMA_LAYER if gemma else LAYER)[module]}.{suffix}"


def _interleave_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute for llama q/k rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tiny_tokenizer(w, vocab_size: int, gemma: bool) -> None:
    """A vocabulary of `vocab_size` entries, as the architecture's files carry one: byte-level BPE
    with no merges, or for Gemma a SentencePiece one (pad, eos, bos, unk, then single letters and
    pieces) with scores, so that transformers makes a tokenizer of it."""
    if not gemma:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(vocab_size)])
        w.add_token_types([1] * vocab_size)
        w.add_token_merges([])
        return
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + [chr(ord("a") + i) for i in range(26)]
    pieces += [f"\u2581{chr(ord('a') + i % 26)}{chr(ord('a') + i // 26)}" for i in range(vocab_size - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(vocab_size - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (vocab_size - 4))
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)


def write_gguf(hf, file_arch: str, path) -> None:
    """`hf`'s weights as llama.cpp writes them; the model's own linear weights become the
    dequantized Q8_0 values, so that it stays the model the file holds."""
    from gguf.quants import dequantize, quantize

    cfg, gemma = hf.config, file_arch == "gemma3"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), file_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0 if gemma else float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(1)
    add_tiny_tokenizer(w, cfg.vocab_size, gemma)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = p.detach().numpy().astype(np.float32)
        rotary = file_arch == "llama" and any(name.endswith(f"{p}_proj.{k}") for p in "qk" for k in ("weight", "bias"))
        if rotary:
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _interleave_rope(data, heads)
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0
        if data.ndim == 2 and "embed" not in name:
            blocks = quantize(data, q8)
            w.add_tensor(_gguf_name(name, gemma), blocks, raw_shape=blocks.shape, raw_dtype=q8)
            with torch.no_grad():  # the interleaving moves whole rows: undo it on the dequantized rows
                back = dequantize(blocks, q8).reshape(data.shape)
                if rotary:
                    back = gguf_arch._unpermute_rope(back, heads)
                p.copy_(torch.from_numpy(back))
        else:
            w.add_tensor(_gguf_name(name, gemma), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, file_arch", [
    ("llama", "llama"), ("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3", "gemma3"),
])
def test_gguf_of_each_architecture_loads_as_the_transformers_model(tmp_path, arch, file_arch):
    hf = hf_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(hf, file_arch, path)
    config = model_config_from_hf(gguf_arch.hf_config(read_header(path)))
    assert config.architecture == type(hf).__name__.replace("Mistral", "Llama")
    if arch == "gemma3":
        assert config.layer_types == ("sliding",) * 5 + ("full",) and config.sliding_window == 5
    model = _empty_model(config, "cpu")
    load_gguf_weights(model, path)
    # q/k/v, o, gate/up, down per layer, and an untied head, kept in their Q8_0 blocks
    expected = 4 * hf.config.num_hidden_layers + (0 if hf.config.tie_word_embeddings else 1)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == expected
    runner = ModelRunner(model.eval(), config, CacheConfig(block_size=4, num_blocks=96), eos_token_ids=())
    groups = len(config.kv_groups())
    ids = torch.randint(0, 97, (13,)).tolist()
    with torch.no_grad():
        expect = hf(torch.tensor([ids])).logits[0]
    out = run(runner, [entry("a", ids[:11], 0, [3, 0, 7], groups)])["a"]
    torch.testing.assert_close(out, expect[:11], atol=5e-5, rtol=0)
    for pos in (11, 12):  # decodes past the window
        out = run(runner, [entry("a", [ids[pos]], pos, [3, 0, 7, 9], groups)])["a"]
        torch.testing.assert_close(out, expect[pos : pos + 1], atol=5e-5, rtol=0)


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_arch.UnsupportedGGUFError, match="'phi3' is not supported; supported: llama, qwen2"):
        gguf_arch.hf_config(read_header(path))
