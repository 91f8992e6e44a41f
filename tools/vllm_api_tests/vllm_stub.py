"""A stand-in for the `vllm` package in the copied tests: `vllm.tokenizers.get_tokenizer` gives the
embedded model's tokenizer (the one the server serves under every name), `current_platform`
answers False to every question; anything else imports, and raises NeedsVllm when used, so
a test that exercises vLLM's own internals fails as "needs vLLM" (not applicable), not as a
wrong answer from Octavo."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class NeedsVllm(Exception):
    pass


class _Thing:
    """What any name from vLLM's internals is here: usable as a type, unusable as a value."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NeedsVllm(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Thing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (NeedsVllmBase,)

    def __or__(self, other):
        return object

    __ror__ = __or__

    def __getitem__(self, item):
        return self


class NeedsVllmBase:
    def __init__(self, *args, **kwargs):
        raise NeedsVllm(type(self).__name__)


class _Platform:
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: False


def get_tokenizer(*args, **kwargs):
    from octavo.models.loader import resolve_model
    from octavo.tokenizer import hf_tokenizer, load_tokenizer

    return hf_tokenizer(load_tokenizer(resolve_model(None)))


def lora_for(repo_id: str) -> str:
    """A LoRA adapter for the embedded model (rank 8 on q and v, seeded random) standing in for the
    adapter repository a test would download; one directory per repository name."""
    import hashlib
    import json
    import os

    import torch
    from safetensors.torch import save_file

    from octavo.models.loader import resolve_model
    from octavo.models.registry import load_model_config

    out = os.path.join(os.environ.get("OCTAVO_SHIM_WORK", "/tmp/vllm-shim"), "loras", repo_id.replace("/", "--"))
    if os.path.isfile(os.path.join(out, "adapter_model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    cfg = load_model_config(resolve_model(None))
    gen = torch.Generator().manual_seed(int(hashlib.sha256(repo_id.encode()).hexdigest()[:8], 16))
    rank, hidden = 8, cfg.hidden_size
    sizes = {"q_proj": cfg.num_heads * cfg.head_dim, "v_proj": cfg.num_kv_heads * cfg.head_dim}
    tensors = {}
    for layer in range(cfg.num_layers):
        for name, rows in sizes.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=gen) * 0.02
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as fh:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(sizes),
                   "base_model_name_or_path": repo_id, "bias": "none", "task_type": "CAUSAL_LM"}, fh)
    return out


class _HfApi:
    def snapshot_download(self, repo_id: str, **kwargs) -> str:
        return lora_for(repo_id)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "hf_api":
            return _HfApi
        if attr == "get_tokenizer":
            return get_tokenizer
        if attr == "current_platform":
            return _Platform()
        return _Thing(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    sys.meta_path.insert(0, _Finder())
