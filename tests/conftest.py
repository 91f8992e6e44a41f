"""Shared fixtures: the embedded model's weights and tokenizer, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# Tests run with a fixed, small thread count so two test processes never fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def _interpret_triton_without_cuda() -> None:
    """Triton kernels run on CPU tensors only in its interpreter, which must be chosen before triton
    is first imported: set it here, for the whole session, unless a GPU is present."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip where torch sees no CUDA device (their CPU-side halves run elsewhere)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smol_dir():
    from octavo.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from octavo.tokenizer import load_tokenizer

    return load_tokenizer(smol_dir)


def _load_smol(smol_dir, smol_tokenizer, quantization: str, activation_dtype: str = "float32"):
    import torch

    from octavo.models.loader import load_model, weight_bytes

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model, _ = load_model(smol_dir, quantization=quantization, activation_dtype=activation_dtype)
    return model, smol_tokenizer, weight_bytes(model)


@pytest.fixture(scope="session")
def smol(smol_dir, smol_tokenizer):
    """(model, tokenizer, weight_bytes) of the embedded model as the engine loads it by default (the
    GGUF's Q4_1 / Q8_0 blocks, float32 activations), shared by every engine in the session."""
    return _load_smol(smol_dir, smol_tokenizer, "auto", "float32")


@pytest.fixture(scope="session")
def smol_int8(smol_dir, smol_tokenizer):
    """The GGUF's blocks through the int8-activation kernels (--activation-dtype int8): not exact,
    checked by tolerance (tests/oracle/test_int8_activations.py)."""
    return _load_smol(smol_dir, smol_tokenizer, "auto", "int8")


@pytest.fixture(scope="session")
def smol_dense(smol_dir, smol_tokenizer):
    """The same model with every weight dequantized to float32 (--quantization none)."""
    return _load_smol(smol_dir, smol_tokenizer, "none")


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' model of the embedded GGUF (it dequantizes it to float32): the oracle. Loaded
    once per session, and only by tests whose references were not kept from an earlier run
    (tests/oracle/reference.py `cached`); never modified (adapters are made on copies)."""
    import torch
    from transformers import AutoModelForCausalLM

    from octavo.models.loader import default_gguf_path

    gguf = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_llm(smol, smol_dir, request):
    """Build an LLM over the shared weights with any EngineArgs fields; weights="dense" for the
    dequantized copy, "int8" for the blocks behind int8-activation kernels. Every other engine runs
    the exact float32 path (activations and KV cache), pinned here (whatever the default becomes)."""
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.llm import LLM
    from octavo.models.registry import load_model_config

    model_config = load_model_config(smol_dir)

    def build(weights: str = "quantized", **kwargs):
        fixture = {"quantized": None, "dense": "smol_dense", "int8": "smol_int8"}[weights]
        model, tokenizer, weight_bytes = smol if fixture is None else request.getfixturevalue(fixture)
        kwargs["activation_dtype"] = "int8" if weights == "int8" else "float32"
        kwargs.setdefault("kv_cache_memory", 256 << 20)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_dtype", "float32")
        config = EngineArgs(**kwargs).to_config(model_config)
        return LLM.from_engine(LLMEngine(config, model, tokenizer, weight_bytes))

    return build


from tests.live_server import live_server  # noqa: E402,F401  (session fixture: one server for all tests)
