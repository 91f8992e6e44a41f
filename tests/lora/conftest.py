"""The LoRA tests' adapters, made once per session with peft (see test_lora.py)."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

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
def skeleton(smol_dir):
    """A transformers model of the embedded model's shape with random weights: adapters are made
    on it (their A and B come from the seeded generator, not from the base's weights), so making
    them needs no 135M-weight load of the GGUF; references use the real base (`hf_smol`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(smol_dir)), dtype=torch.float32).eval()


def make_adapter(base, path, seed: int, rank: int, targets: list[str], rslora: bool) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, init_lora_weights=False,
        use_rslora=rslora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero, small enough that the text stays text
                p.copy_(torch.randn_like(p) * 0.02)
    model.save_pretrained(str(path))


def _files_digest(path) -> str:
    digest = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="session")
def adapters(request, skeleton, tmp_path_factory, smol_tokenizer):
    """name -> (LoRARequest, greedy reference tokens per prompt from transformers + peft on the
    real base; kept between runs, keyed by the adapter's files: tests/oracle/reference.py)."""
    from peft import PeftModel

    from tests.oracle.reference import cached, model_key

    base_key = {"model": model_key(default_gguf_path()), "prompts": PROMPTS, "num_new": NUM_NEW}
    hf = lambda: request.getfixturevalue("hf_smol")  # noqa: E731  (loaded only when a reference is missing)
    out = {}
    for i, (name, (seed, rank, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        path = tmp_path_factory.mktemp(name)
        make_adapter(skeleton, path, seed, rank, targets, rslora)
        refs = cached("lora", {**base_key, "adapter": _files_digest(path)},
                      lambda path=path: greedy(PeftModel.from_pretrained(copy.deepcopy(hf()), str(path)).eval(),
                                               smol_tokenizer))
        out[name] = (LoRARequest(name, i, str(path)), refs)
    out[None] = (None, cached("lora-base", base_key, lambda: greedy(hf(), smol_tokenizer)))
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


