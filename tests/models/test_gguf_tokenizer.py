"""Octavo writes a byte-level BPE GGUF's tokenizer files itself (octavo/models/gguf_tokenizer.py),
without transformers: they must be the files transformers' GGUF converter writes, byte for byte,
on the embedded SmolLM2 and on variants of its metadata covering each rule (pre-tokenizer names,
bos / eos added, special ids absent, user-defined and control tokens, tokens outside GPT-2's byte
alphabet, no chat template); a file it does not handle is left to transformers."""

import filecmp

import gguf
import pytest

from octavo.models import gguf_tokenizer
from octavo.models.gguf_file import ArrayValue, read_header
from octavo.models.loader import _save_gguf_tokenizer_by_transformers, default_gguf_path

FILES = gguf_tokenizer.FILES


def _variant(path, changes: dict, drop: tuple = ()):
    """The embedded SmolLM2's tokenizer metadata (plus the architecture) with `changes` (key ->
    value, a list for an array) and without the keys in `drop`, as a GGUF with no tensors."""
    header = read_header(default_gguf_path())
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in header.metadata.items():
        if not key.startswith("tokenizer.") or key in drop or key in changes:
            continue
        if isinstance(value, ArrayValue):
            items = header.strings(key) if value.elem_type == gguf.GGUFValueType.STRING else header.numbers(key)
            writer.add_key_value(key, items, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(value.elem_type))
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType(header.value_types[key]))
    for key, value in changes.items():
        if isinstance(value, list):
            sub = gguf.GGUFValueType.STRING if isinstance(value[0], str) else gguf.GGUFValueType.INT32
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, gguf.GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, gguf.GGUFValueType.UINT32)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _both(header, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "transformers"
    ours.mkdir()
    theirs.mkdir()
    assert gguf_tokenizer.write_tokenizer(header, ours, "llama", None)
    _save_gguf_tokenizer_by_transformers(header, theirs, "llama")
    return ours, theirs


def _same_files(ours, theirs):
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in FILES:
        if (theirs / name).exists():
            assert filecmp.cmp(ours / name, theirs / name, shallow=False), name


def _smol_tokens():
    header = read_header(default_gguf_path())
    return header.strings("tokenizer.ggml.tokens"), header.numbers("tokenizer.ggml.token_type")


def test_the_embedded_models_tokenizer_files_are_transformers_own(tmp_path):
    _same_files(*_both(read_header(default_gguf_path()), tmp_path))


def _variants():
    tokens, types = _smol_tokens()
    user = list(types)
    for i in (500, 501, 40000):
        user[i] = 4  # user-defined: added whole, not special
    control = list(types)
    control[700] = 3
    respelled = tokens + ["\u65e5\u672c", "caf\u00e9 \u20ac"]  # outside GPT-2's byte alphabet
    respelled_types = types + [1, 3]  # a control token spelled outside the alphabet: skipped
    return {
        "llama3 split": ({"tokenizer.ggml.pre": "llama-bpe"}, ()),
        "qwen2 split": ({"tokenizer.ggml.pre": "qwen2"}, ()),
        "no pre name": ({}, ("tokenizer.ggml.pre",)),
        "bos added": ({"tokenizer.ggml.add_bos_token": True}, ()),
        "bos and eos added": ({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}, ()),
        "no flags": ({}, ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")),
        "no unk, no pad": ({}, ("tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")),
        "no bos id, bos added": ({"tokenizer.ggml.add_bos_token": True}, ("tokenizer.ggml.bos_token_id",)),
        "no template": ({}, ("tokenizer.chat_template",)),
        "user-defined tokens": ({"tokenizer.ggml.token_type": user}, ()),
        "another control token": ({"tokenizer.ggml.token_type": control}, ()),
        "tokens outside the byte alphabet": ({"tokenizer.ggml.tokens": respelled,
                                              "tokenizer.ggml.token_type": respelled_types}, ()),
        "<|endoftext|> absent": ({"tokenizer.ggml.tokens": ["<|eot|>"] + tokens[1:]}, ()),
    }


@pytest.mark.parametrize("name", list(_variants()))
def test_each_rule_writes_what_transformers_writes(tmp_path, name):
    changes, drop = _variants()[name]
    header = read_header(_variant(tmp_path / "v.gguf", changes, drop))
    _same_files(*_both(header, tmp_path))


def test_files_it_does_not_handle_are_left_to_transformers(tmp_path):
    header = read_header(_variant(tmp_path / "v.gguf", {"tokenizer.ggml.pre": "tekken"}))
    assert not gguf_tokenizer.write_tokenizer(header, tmp_path, "llama", None)
    assert not gguf_tokenizer.write_tokenizer(read_header(default_gguf_path()), tmp_path, "qwen2", None)
    assert list(tmp_path.iterdir()) == [tmp_path / "v.gguf"]


def test_the_generic_class_is_what_transformers_maps_these_model_types_to():
    """The files say TokenizersBackend: true only while transformers maps the architecture there."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    for model_type in gguf_tokenizer.MODEL_TYPES:
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, "TokenizersBackend"), model_type


def test_the_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gguf_tokenizer.byte_alphabet() == bytes_to_unicode()


def test_converting_the_embedded_model_imports_no_transformers(tmp_path):
    """The point of writing these files here: a first start of such a file (conversion, load,
    tokenizer) never imports transformers (~1 s)."""
    import os
    import subprocess
    import sys

    from octavo.cache import cache_dir

    (tmp_path / "kernels").symlink_to(cache_dir() / "kernels")
    script = ("import sys; from octavo.models.loader import default_gguf_path, resolve_model, load_model; "
              "from octavo.tokenizer import load_tokenizer; d = resolve_model(default_gguf_path()); "
              "load_model(d, quantization='auto'); load_tokenizer(d); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OCTAVO_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (next((tmp_path / "models").glob("*/tokenizer.json"))).is_file()
