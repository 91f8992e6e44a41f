"""Loader and registry: clear errors for unsupported or incomplete models; GGUF q/k row order."""

import json

import numpy as np
import pytest

from octavo.models.loader import _unpermute_rope, resolve_model
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
