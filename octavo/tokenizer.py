"""Loading a model directory's tokenizer and applying its chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


# tokenizer_config.json classes that are transformers' generic tokenizers.json wrapper (what a GGUF
# converted here names): loaded by that class itself. AutoTokenizer resolves the same class, but
# its name lookup imports the model registry and torch.distributed.tensor: 2-3 s of a start.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's Hugging Face tokenizer (fast, from tokenizer.json). Never downloads."""
    try:
        name = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in _GENERIC_TOKENIZERS:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def encode_prompt(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render `messages` (and `tools`, for templates that take them) with the model's chat
    template and tokenize (the template adds specials)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools)
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
