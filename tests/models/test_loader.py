"""Loader and registry: clear errors for unsupported or incomplete models; GGUF q/k row order."""

import json

import numpy as np
import pytest

from octavo.models.gguf_arch import _unpermute_rope
from octavo.models.loader import resolve_model
from octavo.models.registry import UnsupportedModelError, model_config_from_hf

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2,
}


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        model_config_from_hf({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        model_config_from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_defaults_for_missing_optional_fields():
    cfg = model_config_from_hf({**BASE, "eos_token_id": [3, 4]})
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4 and cfg.eos_token_ids == (3, 4)


def test_missing_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(FileNotFoundError, match=r"missing: \*\.safetensors weights, tokenizer\.json"):
        resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_unpermute_inverts_the_gguf_rope_permutation():
    # the GGUF writer's row order for one head of dim 8: pairs interleaved [head, 2, pair] -> [head, pair, 2]
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(_unpermute_rope(permuted, heads), w)


def test_a_gguf_converts_without_float32_weights_until_asked(tmp_path, monkeypatch):
    """The first start reads the GGUF's config, tokenizer and blocks only; float32 safetensors are
    written when something needs them (here --quantization none), and then load the same model."""
    import torch

    from octavo.cache import cache_dir
    from octavo.models.loader import DENSE_WEIGHTS_FILE, dense_weights, load_model

    (tmp_path / "kernels").symlink_to(cache_dir() / "kernels")  # built already: only the model is new
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model(None)
    assert model_dir.is_relative_to(tmp_path)
    assert not (model_dir / DENSE_WEIGHTS_FILE).exists()
    quantized, _ = load_model(model_dir, quantization="auto")
    assert not (model_dir / DENSE_WEIGHTS_FILE).exists()
    dense, _ = load_model(model_dir, quantization="none")
    assert (model_dir / DENSE_WEIGHTS_FILE).stat().st_size > 500e6
    assert dense_weights(model_dir) == model_dir
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314])
    assert torch.equal(quantized.embed_tokens(ids), dense.embed_tokens(ids))
