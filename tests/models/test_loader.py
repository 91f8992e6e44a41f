"""Loader and registry: clear errors for unsupported or incomplete models; GGUF q/k row order."""

import json
import math

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
    with pytest.raises(UnsupportedModelError, match="rope type 'dynamic' is not supported; supported: default, linear, llama3, yarn, longrope"):
        model_config_from_hf({**BASE, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})


def test_yarn_without_an_original_context_takes_the_models():
    rope = model_config_from_hf({**BASE, "max_position_embeddings": 4096,
                                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}).rope
    assert (rope.scaling_type, rope.factor, rope.original_max_position) == ("yarn", 4.0, 4096)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


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


def test_a_gguf_replaced_in_place_with_the_same_size_and_time_is_converted_again(tmp_path, monkeypatch):
    """`cp -p` / `rsync -a` of another model over the file keeps its size and modification time:
    the conversion is keyed by content, so the new weights are the ones loaded. The old file's
    conversion reads its blocks from the file, so it is refused from then on, saying why (a model
    loaded before keeps the old file's pages)."""
    import os

    import torch

    from octavo.models.loader import load_model
    from tests.models.gguf_writer import hf_model, write_gguf

    from octavo.cache import cache_dir

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")  # built already: only the model is new
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "model.gguf", tmp_path / "other.gguf"
    write_gguf(hf_model("gemma3"), "gemma3", first)
    other = hf_model("gemma3")
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(-1)  # the same shapes and bytes: other weights
    write_gguf(other, "gemma3", second)
    assert first.stat().st_size == second.stat().st_size
    before = resolve_model(first)
    old = load_model(before, quantization="auto")[0]
    stat = first.stat()
    os.replace(second, first)
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = resolve_model(first)
    assert after != before
    new = load_model(after, quantization="auto")[0]
    with pytest.raises(ValueError, match="changed since it was converted"):
        load_model(before, quantization="auto")
    assert new.config == old.config
    down = lambda m: m.layers[1].mlp.down_proj  # noqa: E731
    x = torch.randn(2, 96)
    torch.testing.assert_close(down(new)(x), -down(old)(x))


def test_dtype_auto_follows_the_weights_and_the_cpu_flags_never_a_timing(monkeypatch):
    """The same file gets the same numerics on every start, loaded or idle: --dtype auto reads the
    stored dtype and the CPU's flags only (a start-up timing once picked bfloat16 under load)."""
    import torch

    from octavo import cpu_features
    from octavo.models.loader import auto_dtype
    from octavo.models.layers import QuantLinear
    from octavo.quantization import Q8_0, quantize

    def no_timing(*args, **kwargs):
        raise AssertionError("--dtype auto must not time anything")

    monkeypatch.setattr(cpu_features, "bf16_matmul_speedups", no_timing)
    dense = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantized = torch.nn.Sequential(QuantLinear(quantize(torch.randn(64, 64), Q8_0), Q8_0, 64, None, prepare=False))
    for flags, stored, model, expect in (
        ({"avx512_bf16", "amx_bf16"}, "bfloat16", dense, "bfloat16"),
        ({"avx512_bf16"}, "bfloat16", dense, "float32"),  # bf16 units without AMX measured slower here
        ({"avx512_bf16", "amx_bf16"}, "float32", dense, "float32"),  # a converted GGUF says float32
        ({"avx512_bf16", "amx_bf16"}, None, dense, "float32"),
        ({"avx512_bf16", "amx_bf16"}, "bfloat16", quantized, "float32"),
    ):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        dtype, why = auto_dtype(model, "cpu", stored)
        assert dtype == expect and why, (flags, stored, dtype, why)


def test_a_converted_file_is_not_checked_again_at_the_next_start(tmp_path, monkeypatch):
    """The check decodes every vocabulary entry and BPE merge (~0.8 s for Llama 3's); a file whose
    content key names a whole conversion was checked when it was converted."""
    from octavo import cli
    from octavo.cache import cache_dir
    from octavo.models import gguf_arch
    from octavo.models.converted import converted_dir
    from tests.models.gguf_writer import hf_model, write_gguf

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(hf_model("llama"), "llama", path)
    checked = []
    real = gguf_arch.check_model
    monkeypatch.setattr(gguf_arch, "check_model", lambda header, *a: checked.append(header.path) or real(header, *a))
    assert converted_dir(path) is None
    cli.check_model_file(str(path))
    assert len(checked) == 1  # not converted yet: checked
    out = resolve_model(path)
    assert len(checked) == 2 and converted_dir(path) == out  # the conversion checks it itself
    cli.check_model_file(str(path))
    assert resolve_model(path) == out and len(checked) == 2  # converted: neither checks it again


def test_the_conversions_tokenizer_is_the_one_autotokenizer_makes_of_the_file(tmp_path):
    """The conversion names the tokenizer class AutoTokenizer maps the architecture to (AutoTokenizer
    itself first builds the model's config through a slow reader): same tokenizer files."""
    import filecmp

    from transformers import AutoTokenizer

    from octavo.models import gguf_arch
    from octavo.models.gguf_file import read_header
    from octavo.models.loader import _save_gguf_tokenizer, _write_tokenizer_gguf, default_gguf_path

    header = read_header(default_gguf_path())
    (tmp_path / "ours").mkdir()
    _save_gguf_tokenizer(header, tmp_path / "ours", gguf_arch.hf_config(header)["model_type"])
    _write_tokenizer_gguf(header, tmp_path / "t.gguf")
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    auto.chat_template = auto.chat_template or gguf_arch.default_chat_template(gguf_arch.architecture(header))
    auto.save_pretrained(str(tmp_path / "auto"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / "ours" / name, tmp_path / "auto" / name, shallow=False), name


def test_the_tokenizer_gguf_holds_the_files_tokenizer_keys_as_gguf_py_reads_them(tmp_path):
    """The scratch GGUF transformers makes the tokenizer from copies the file's arrays byte for
    byte: gguf-py's own reader finds every tokenizer key with the values Octavo's header reads."""
    import gguf

    from octavo.models.gguf_file import ArrayValue, read_header
    from octavo.models.loader import _write_tokenizer_gguf, default_gguf_path

    header = read_header(default_gguf_path())
    _write_tokenizer_gguf(header, tmp_path / "t.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    fields = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    wanted = [k for k in header.metadata if k.startswith("tokenizer.") or k.startswith("llama.")]
    assert set(fields) == set(wanted) | {"general.architecture", "general.name"}
    for key in wanted:
        value = header.get(key)
        if isinstance(value, ArrayValue):
            expected = header.strings(key) if value.elem_type == 8 else header.numbers(key)
            assert list(fields[key].contents()) == expected, key
        else:
            got = fields[key].contents()
            assert got == value or got == pytest.approx(value), key


def test_a_conversion_keeps_only_the_blocks_it_changed_and_reads_the_rest_from_the_file(tmp_path, monkeypatch):
    """Blocks the file holds as they are are views of the mapped GGUF, never copied into the cache:
    the cache keeps Llama's q/k (rows un-interleaved) and the float32 tensors, nothing else, and a
    later load's other blocks share the file's bytes."""
    import numpy as np
    import torch

    from octavo.cache import cache_dir
    from octavo.models.converted import GGUF_BLOCKS_FILE
    from octavo.models.gguf_file import read_header
    from octavo.models.loader import _gguf_tensors, map_safetensors
    from tests.models.gguf_writer import hf_model, write_gguf

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(hf_model("llama"), "llama", tmp_path / "m.gguf")
    model_dir = resolve_model(tmp_path / "m.gguf")
    _, kept = map_safetensors(model_dir / GGUF_BLOCKS_FILE)
    assert kept and all(n.endswith(("q_proj.weight", "k_proj.weight")) or kept[n].dtype == torch.float32 for n in kept)
    assert any(n.endswith("q_proj.weight") for n in kept)
    header = read_header(tmp_path / "m.gguf")
    data = np.fromfile(tmp_path / "m.gguf", dtype=np.uint8)
    from_file = 0
    for name, tensor, fmt in _gguf_tensors(tmp_path / "m.gguf", model_dir):
        if name in kept:
            continue
        assert fmt is not None, name  # (every float32 tensor is kept)
        assert any(t.num_bytes == tensor.numel() and np.array_equal(data[t.offset : t.offset + t.num_bytes],
                                                                    tensor.numpy().reshape(-1))
                   for t in header.tensors.values()), name  # the file's bytes as they lie
        from_file += 1
    assert from_file > 0
