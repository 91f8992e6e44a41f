"""OpenAI-compatible request models (pydantic), their limits, and their mapping to SamplingParams.

Every value is bounded here, before it reaches the engine: numbers are finite and in range,
lists have a maximum length, strings are valid Unicode (no lone surrogates, which JSON can carry
but UTF-8 cannot encode). Unknown fields are ignored, as OpenAI-compatible servers do; known
OpenAI fields this server cannot honour are refused with a 400 (`unsupported`), never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from octavo.sampling.params import (
    MAX_BEAM_WIDTH,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)

MAX_PROMPTS_PER_REQUEST = 64
MAX_MESSAGES = 1024
INT32_MAX = 2**31 - 1


def _reject_invalid_unicode(value: Any, depth: int = 0) -> None:
    """Raise ValueError if a string anywhere in `value` cannot be encoded as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text contains invalid Unicode (a lone surrogate at character {exc.start})") from None
    elif isinstance(value, dict) and depth < 64:
        for k, v in value.items():
            _reject_invalid_unicode(k, depth + 1)
            _reject_invalid_unicode(v, depth + 1)
    elif isinstance(value, list) and depth < 64:
        for v in value:
            _reject_invalid_unicode(v, depth + 1)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _reject_invalid_unicode(data)
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    user: str | None = None
    # OpenAI fields Octavo does not implement: accepted in the schema so that a value is refused
    # with a clear 400 (see `unsupported`) rather than silently ignored.
    logit_bias: dict[str, Any] | None = Field(None, max_length=1024)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to a value this server cannot honour."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "response_format other than {\"type\": \"text\"} is not supported by this server"
        if self.tools or self.functions:
            return ("tools" if self.tools else "functions"), "tool and function calling is not supported by this server"
        if self.tool_choice not in (None, "none", "auto") or self.function_call not in (None, "none", "auto"):
            return "tool_choice", "tool_choice / function_call is not supported by this server"
        if isinstance(self.stop, str) and not 1 <= len(self.stop) <= MAX_STOP_STRING_CHARS:
            return "stop", f"stop must be 1 to {MAX_STOP_STRING_CHARS} characters"
        return None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's {"token id as a string": bias}; ValueError naming logit_bias otherwise."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")
            out[token] = float(value)
        return out

    def to_sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError with SamplingParams' message when a value is out of range."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.max_tokens if self.max_tokens is not None else default_max_tokens,
            "seed": self.seed,
            "stop": self.stop or (),
            "stop_token_ids": self.stop_token_ids or (),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "logit_bias": self._logit_bias(),
            "output_kind": RequestOutputKind.DELTA,
        }
        for name, default in (
            ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0),
        ):
            value = getattr(self, name)
            kwargs[name] = default if value is None else value
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's beam-search fields: `n` is the beam width and the number of choices returned
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-100, le=100)
    early_stopping: bool | Literal["never"] = False

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """Raises ValueError naming the field when beam search cannot take this request as it is."""
        if self.n > MAX_BEAM_WIDTH:
            raise ValueError(f"n: with use_beam_search n is the beam width, at most {MAX_BEAM_WIDTH}; got {self.n}")
        if self.stream:
            raise ValueError("stream: beam search returns its beams when the search ends; use stream=false")
        if self.logprobs is not None:
            raise ValueError("logprobs: not returned with beam search (each choice's beams are scored as a whole)")
        if self.temperature not in (None, 0, 0.0):
            raise ValueError("temperature: beam search here is deterministic; leave temperature unset or 0")
        if self.stop or self.stop_token_ids:
            raise ValueError("stop: stop strings and stop_token_ids are not applied to beams; EOS ends a beam")
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            length_penalty=self.length_penalty,
            ignore_eos=self.ignore_eos,
            early_stopping=self.early_stopping,
        )

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by this server"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported by this server (use n)"
        return super().unsupported()

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list (a single string or token list becomes a list of one)."""
        raw = self.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]  # type: ignore[list-item]
        return list(raw)  # type: ignore[arg-type]


class ContentPart(_Body):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text'")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (a string) or 'messages'")
        return self


class DetokenizeRequest(_Body):
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body), only with --allow-runtime-lora-updating."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=256)
