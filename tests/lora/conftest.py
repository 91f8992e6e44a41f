"""The LoRA tests' adapters, made once per session with peft (see test_lora.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from octavo.lora.request import LoRARequest
from octavo.models.loader import default_gguf_path

NUM_NEW = 16
ADAPTERS = {  # name: (seed, rank, targets, rslora)
    "alpha": (1, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "beta": (2, 8, ["q_proj", "v_proj", "down_proj"], True),
    "gamma": (3, 4, ["k_proj", "o_proj", "gate_proj", "up_proj"], False),
}
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,", "Water boils at"]


@pytest.fixture(scope="session")
def hf_base():
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def make_adapter(hf_base, path, seed: int, rank: int, targets: list[str], rslora: bool):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(hf_base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
        use_rslora=rslora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero, small enough that the text stays text
                p.copy_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(path))
    return model.eval()


@pytest.fixture(scope="session")
def adapters(hf_base, tmp_path_factory, smol_tokenizer):
    """name -> (LoRARequest, greedy reference tokens per prompt from transformers + peft)."""
    out = {}
    for i, (name, (seed, rank, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        path = tmp_path_factory.mktemp(name)
        model = make_adapter(hf_base, path, seed, rank, targets, rslora)
        out[name] = (LoRARequest(name, i, str(path)), greedy(model, smol_tokenizer))
    out[None] = (None, greedy(hf_base, smol_tokenizer))
    return out


def greedy(model, tokenizer) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tokenizer.encode(p)])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                                 min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=2)
            refs.append(out[0, ids.shape[1]:].tolist())
    return refs


