"""A GGUF's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2": Llama 3.x, SmolLM and most
files of the llama architecture) written as the HF tokenizer files transformers' GGUF converter
makes of it, byte for byte (tests/models/test_gguf_tokenizer.py holds them side by side), with the
`tokenizers` library alone. A first start no longer imports transformers (~1 s) nor runs its
converter for these files (1.3 s of the 1B shape's first start, 1.5 s of SmolLM2's).

What the converter does with such a file, and this module after it: the vocabulary spelled in
GPT-2's byte alphabet (a token with any other character re-spelled from its UTF-8 bytes), the
file's merges, GPT-2's byte-level pre-tokenizer (or, for the pre-tokenizer names below, the
model's split pattern before it), the byte-level decoder; added as special tokens: GPT-2's
default `<|endoftext|>` (a new id past the vocabulary when the file lacks it), the tokens the file
marks as control (type 3) and spells in the byte alphabet, then the file's bos / eos / unk / pad
tokens; added as plain tokens: those marked user-defined (type 4). A bos / eos token is put
around each sequence when the file sets `add_bos_token` / `add_eos_token`.

Anything else (another tokenizer model, another pre-tokenizer name, another architecture, whose
tokenizer class transformers maps to one with its own rules) returns False: the caller uses
transformers' converter, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from octavo.models.gguf_file import GGUFHeader

# The regexes are the models' published pre-tokenizer split patterns (Llama 3's tiktoken pattern,
# Qwen 2's), which transformers' converter uses for these `tokenizer.ggml.pre` names.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS: dict[str | None, str | None] = {
    None: None, "default": None, "gpt-2": None, "smollm": None,  # GPT-2's own byte-level split
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# model types whose tokenizer class in transformers is its generic one (no rules of its own)
MODEL_TYPES = ("llama",)
CONTROL, USER_DEFINED = 3, 4
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))
_NO_LIMIT = 1000000000000000019884624838656  # transformers' "no maximum length" (int(1e30)), as it saves it


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: the printable Latin-1 bytes as themselves, every
    other byte as the next code point from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def handles(header: GGUFHeader, model_type: str) -> bool:
    return (model_type in MODEL_TYPES and header.get("tokenizer.ggml.model") == "gpt2"
            and header.get("tokenizer.ggml.pre") in SPLITS and bool(header.get("tokenizer.ggml.tokens")))


def write_tokenizer(header: GGUFHeader, out: Path, model_type: str, chat_template: str | None) -> bool:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja (the file's template, else
    `chat_template` if given) in `out`, as transformers writes them; False (nothing written) for a
    file this does not handle."""
    if not handles(header, model_type):
        return False
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tokens = header.strings("tokenizer.ggml.tokens")
    types = header.numbers("tokenizer.ggml.token_type")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in header.strings("tokenizer.ggml.merges")]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False))
    split = SPLITS[header.get("tokenizer.ggml.pre")]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = lambda content: AddedToken(content, special=True, normalized=False)  # noqa: E731
    tok.add_special_tokens([special("<|endoftext|>")])  # GPT-2's default unk / bos / eos
    tok.add_special_tokens([special(t) for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED and t in vocab])
    named = {name: None if header.get(f"tokenizer.ggml.{key}") is None else tokens[int(header.get(f"tokenizer.ggml.{key}"))]
             for name, key in _SPECIAL_IDS}
    tok.add_special_tokens([special(t) for t in named.values() if t is not None])
    bos = named["bos_token"] if header.get("tokenizer.ggml.add_bos_token") else None
    eos = named["eos_token"] if header.get("tokenizer.ggml.add_eos_token") else None
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in (bos, eos) if t])
    tok.save(str(out / "tokenizer.json"))
    config = {"backend": "tokenizers", **named, "is_local": True, "local_files_only": False,
              "model_max_length": _NO_LIMIT, "tokenizer_class": "TokenizersBackend"}
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    template = header.get("tokenizer.chat_template") or chat_template
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return True
