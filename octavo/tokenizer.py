"""Loading a model directory's tokenizer and applying its chat template.

A directory whose tokenizer is transformers' plain wrapper of a tokenizer.json (what every GGUF
converted here gets) is served by `Tokenizer`: the file through the `tokenizers` library and the
chat template through jinja2 in the sandbox and with the helpers transformers gives templates. Its
token ids and rendered text equal transformers' (tests/test_tokenizer.py compares them on every
model directory the suite has); importing transformers costs ~1 s of every start, so its
tokenizer object is made only when something asks for what `Tokenizer` does not do itself
(xgrammar's vocabulary view, attributes reached through `Tokenizer.hf`). Other directories get
transformers' tokenizer, as before."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from octavo.chat_template.sandbox import RenderBudget, compile_chat_template, render_chat


# tokenizer_config.json classes that are transformers' generic tokenizers.json wrapper (what a GGUF
# converted here names): loaded by that class itself. AutoTokenizer resolves the same class, but
# its name lookup imports the model registry and torch.distributed.tensor: 2-3 s of a start.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Classes whose transformers object encodes and decodes exactly as its tokenizer.json does when the
# config sets none of _CHANGES_BEHAVIOUR (checked on every converted directory by the tests).
_PLAIN_TOKENIZERS = (*_GENERIC_TOKENIZERS, "GemmaTokenizer", "Qwen2Tokenizer")
# tokenizer_config.json keys with which transformers changes the file's encoding or decoding.
_CHANGES_BEHAVIOUR = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow",
                      "split_special_tokens", "do_lower_case")
# apply_chat_template's options that transformers' object handles (not template variables).
_HF_CHAT_OPTIONS = ("sanitize_control_tokens", "padding",
                    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                    "tokenizer_kwargs")
# Named special tokens, in transformers' order (its special_tokens_map, passed to chat templates).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's tokenizer: `Tokenizer` where the directory's tokenizer.json is all there is
    to it, else transformers' (fast, from tokenizer.json). Never downloads."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and Tokenizer.serves(model_dir, config):
        return Tokenizer(model_dir, config)
    return load_hf_tokenizer(model_dir)


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """transformers' tokenizer of the directory (the class its tokenizer_config.json names)."""
    try:
        name = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in _GENERIC_TOKENIZERS:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it (a string, or an AddedToken's dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A tokenizer.json and its tokenizer_config.json, with the calls the engine and the server
    make: encode, decode, the vocabulary, special tokens, the chat template. Anything else is
    looked up on transformers' tokenizer of the same directory, made on first use (`hf`)."""

    @staticmethod
    def serves(model_dir: Path, config: dict[str, Any]) -> bool:
        """Whether this class gives what transformers would for the directory."""
        if config.get("tokenizer_class") not in _PLAIN_TOKENIZERS or any(config.get(k) for k in _CHANGES_BEHAVIOUR):
            return False
        if config.get("clean_up_tokenization_spaces") or (model_dir / "additional_chat_templates").exists():
            return False
        template = config.get("chat_template")
        return (model_dir / "tokenizer.json").is_file() and (template is None or isinstance(template, str))

    def __init__(self, model_dir: str | Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer as _Backend

        self.model_dir = Path(model_dir)
        self._config = config
        self.tokenizer_class = str(config.get("tokenizer_class"))
        self.backend = _Backend.from_file(str(self.model_dir / "tokenizer.json"))
        template_file = self.model_dir / "chat_template.jinja"  # transformers reads it before the config's
        self.chat_template: str | None = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                                          else config.get("chat_template"))
        self.special_tokens_map = {name: text for name in SPECIAL_TOKEN_NAMES
                                   if (text := _token_text(config.get(name))) is not None}
        self._compiled: Any = None
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    # ---- text in and out ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self.backend.get_added_tokens_decoder()

    # ---- special tokens ----------------------------------------------------------------------

    def _special(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend.token_to_id(text)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    mask_token = property(lambda self: self._special("mask_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    # ---- the chat template -------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            budget: RenderBudget | None = None, **kwargs: Any) -> Any:
        """The conversation rendered by the model's chat template (or `chat_template`, a template's
        source), as transformers renders it, within `budget` (sandbox.RenderBudget's defaults when
        None). `tokenize=False` and template variables (`documents` among them) are rendered here;
        tokenizing, batches and transformers' other options go to `hf`."""
        if tokenize or not isinstance(conversation, list) or any(k in _HF_CHAT_OPTIONS for k in kwargs):
            return self.hf.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=tokenize, chat_template=chat_template,
                                               continue_final_message=continue_final_message, **kwargs)
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model's tokenizer has no chat template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if chat_template:
            compiled = compile_chat_template(chat_template)
        else:
            if self._compiled is None:
                self._compiled = compile_chat_template(self.chat_template)
            compiled = self._compiled
        return render_chat(compiled, conversation, tools, add_generation_prompt, {**self.special_tokens_map, **kwargs},
                           budget, continue_final_message)

    # ---- everything else: transformers' object -----------------------------------------------

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of this directory (made once, on first use: ~1-2 s)."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = load_hf_tokenizer(self.model_dir)
                if self.chat_template is not None:  # --chat-template's, where one replaced the file's
                    self._hf.chat_template = self.chat_template
            return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_dir"], state["config"])

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.model_dir)!r}, {len(self)} tokens, as {self.tokenizer_class})"


def set_chat_template(tokenizer: Any, source: str) -> None:
    """Replace `tokenizer`'s chat template (ours or transformers') with `source`."""
    tokenizer.chat_template = source
    if isinstance(tokenizer, Tokenizer):
        tokenizer._compiled = None
        if tokenizer._hf is not None:
            tokenizer._hf.chat_template = source


def hf_tokenizer(tokenizer: Any) -> Any:
    """transformers' object behind `tokenizer` (itself if it is one): for libraries that want it."""
    return tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer


def encode_prompt(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> list[int]:
    """Render `messages` (and `tools`, for templates that take them) with the model's chat
    template and tokenize (the template adds specials). `kwargs`: template variables
    (chat_template_kwargs such as enable_thinking) and transformers' options
    (continue_final_message, chat_template)."""
    if not getattr(tokenizer, "chat_template", None) and not kwargs.get("chat_template"):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose token i is the word "t<i>": for random-weight models that come
    with no tokenizer files (tests, scripts/gpu_check.py). Prompts are given as token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
