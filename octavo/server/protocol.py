"""OpenAI-compatible request models (pydantic), their limits, and their mapping to SamplingParams.

Every value is bounded here, before it reaches the engine: values have their JSON type (no
string-to-number or bool-to-number coercion), numbers are finite and in range,
lists have a maximum length, strings are valid Unicode (no lone surrogates, which JSON can carry
but UTF-8 cannot encode). Unknown fields are ignored, as OpenAI-compatible servers do; known
OpenAI fields this server cannot honour are refused with a 400 (`unsupported`), never ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from octavo.json_limits import MAX_JSON_DEPTH, is_nested_too_deeply, loads_bounded
from octavo.sampling.params import (
    MAX_ALLOWED_TOKEN_IDS,
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
    StructuredOutputsParams,
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


# Fields other OpenAI-compatible servers take that Octavo does not implement: a request that sets
# one (to anything but its neutral value) gets a 400 naming it instead of having it ignored.
# Fields nobody defines are ignored, as OpenAI-compatible servers do.
REFUSED_FIELDS = {
    "audio": "audio output", "prediction": "predicted outputs", "web_search_options": "web search",
    "reasoning_effort": "reasoning effort", "verbosity": "verbosity", "metadata": "stored-completion metadata",
    "store": "stored completions", "functions": "the legacy functions field (use tools)",
    "function_call": "the legacy function_call field (use tool_choice)", "guided_whitespace_pattern": "guided_whitespace_pattern",
    "structural_tag": "structural tags", "bad_words": "bad_words",
    "logits_processors": "custom logits processors", "chat_template": "a per-request chat template",
    "chat_template_kwargs": "chat_template_kwargs", "documents": "documents", "continue_final_message": "continue_final_message",
    "mm_processor_kwargs": "multimodal inputs", "prompt_embeds": "prompt embeddings", "kv_transfer_params": "KV transfer",
    "vllm_xargs": "vllm_xargs", "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logprobs_mode": "logprobs_mode",
}
# template variables a request may not set through chat_template_kwargs (the server sets them)
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
                                    "continue_final_message", "return_dict", "return_tensors", "tokenizer_kwargs",
                                    "padding", "truncation", "max_length", "return_assistant_tokens_mask",
                                    "sanitize_control_tokens", "bos_token", "eos_token"})
_NEUTRAL = {"modalities": (["text"],), "service_tier": ("auto", "default"), "guided_decoding_backend": ("xgrammar", "auto")}


class _Body(BaseModel):
    # strict: no string-to-number, no bool-to-number ("max_tokens": "8" and "input": [true] are
    # refused, as OpenAI and Anthropic refuse them); a JSON integer still fills a float field
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def refused_extra(self, honoured: tuple[str, ...] = ()) -> tuple[str, str] | None:
        """(field, message) of the first set field this server knows of but does not implement on
        this route (`honoured`: extras this route reads, refused elsewhere)."""
        for name, value in (self.model_extra or {}).items():
            if name in honoured or value in (None, False, [], {}, "") or value in _NEUTRAL.get(name, ()):
                continue
            if name in REFUSED_FIELDS:
                return name, f"{name}: {REFUSED_FIELDS[name]} is not supported by this server"
            if name in _NEUTRAL:
                return name, f"{name}: only {', '.join(map(repr, _NEUTRAL[name]))} is supported by this server"
        return None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _reject_invalid_unicode(data)
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


MAX_SPEC_CHARS = 64 * 1024
MAX_USER_CHARS = 256  # the end-user id a client may pass (`user`)
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_TOOLS = 128


class JSONSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's {name, schema, strict, description}."""

    name: str = Field("response", max_length=256)
    description: str | None = None
    json_schema_body: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


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
    # OpenAI's hint that requests share a prefix: `octavo router` sends requests of one key to one
    # replica; a replica's own prefix cache finds the shared blocks by their content either way
    prompt_cache_key: str | None = Field(None, max_length=1024)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    logit_bias: dict[str, Any] | None = Field(None, max_length=1024)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra
    # vLLM's: sample only among these tokens; keep the prompt's last k tokens (-1: as many as fit);
    # return the prompt's and the output's token ids; name logprob tokens "token_id:<id>"
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    logprob_token_ids: list[int] | None = Field(None, min_length=1, max_length=1024)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_SPEC_CHARS)
    guided_choice: list[str] | None = Field(None, max_length=256)
    guided_grammar: str | None = Field(None, max_length=MAX_SPEC_CHARS)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field set to a value this server cannot honour."""
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM answer
            return "stream_options", "stream_options: only allowed when stream is true"
        if isinstance(self.stop, str) and not 1 <= len(self.stop) <= MAX_STOP_STRING_CHARS:
            return "stop", f"stop must be 1 to {MAX_STOP_STRING_CHARS} characters"
        return self.refused_extra()

    def structured_param(self) -> str:
        """The field the output constraint came from (what a 400 about it names)."""
        return next((n for n in _CONSTRAINT_FIELDS if self._is_set(n)), "response_format")

    def structured_fields_set(self) -> bool:
        return any(self._is_set(n) for n in _CONSTRAINT_FIELDS)

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        if name == "response_format":
            return value is not None and value.type != "text"
        return value not in (None, {})

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (ValueError naming the fields if several)."""
        asked: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema_body is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            asked.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema_body)))
        if self.structured_outputs:
            fields = {k: v for k, v in self.structured_outputs.items() if v not in (None, False)}
            known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
            unknown = sorted(set(fields) - known)
            if unknown:
                raise ValueError(f"structured_outputs: unsupported field(s) {', '.join(unknown)}; "
                                 f"supported: {', '.join(sorted(known))}")
            try:
                asked.append(("structured_outputs", StructuredOutputsParams(**fields)))
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, StructuredOutputsParams(**{kind: value})))
        if len(asked) > 1:
            raise ValueError(f"{asked[0][0]}: give one output constraint, not {' and '.join(n for n, _ in asked)}")
        return asked[0][1] if asked else None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's {"token id as a string": bias}; ValueError naming logit_bias otherwise."""
        out = {}
        bad = [k for k in (self.logit_bias or {}) if not str(k).lstrip("-").isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids, got {', '.join(map(repr, bad[:16]))}")
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            # compared before float(): a 400-digit integer would overflow it
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {str(value)[:40]}")
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
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": self.structured(),
            "allowed_token_ids": tuple(self.allowed_token_ids) if self.allowed_token_ids else None,
            "logprob_token_ids": tuple(self.logprob_token_ids) if self.logprob_token_ids else None,
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

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One clear message for a prompt of the wrong shape or an empty one (pydantic's own, for
        a union of four shapes, names only the first: "prompt.str: Input should be a valid string")."""
        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)
        if isinstance(value, str):
            if not value:
                raise ValueError("is empty; give at least one character or token id")
            return value
        if isinstance(value, list) and value and (is_ids(value) or all(isinstance(v, str) and v for v in value)
                                                  or all(is_ids(v) for v in value)):
            return value
        if value in ([], [""], [[]]) or (isinstance(value, list) and any(v in ("", []) for v in value)):
            raise ValueError("is empty; give at least one character or token id")
        raise ValueError("must be a string, a list of token ids (integers), a list of strings or a list of "
                         f"token-id lists; got {type(value).__name__}" + (" with other items" if isinstance(value, list)
                                                                           else ""))

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
        # fields beam search here does not apply: refused by name rather than silently ignored
        neutral = {"top_p": (1,), "top_k": (0, -1), "min_p": (0,), "seed": (), "presence_penalty": (0,),
                   "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,), "logit_bias": ({},)}
        for name, values in neutral.items():
            value = getattr(self, name)
            if value is not None and value not in values:
                raise ValueError(f"{name}: not applied by beam search (beams are ranked by the model's own logprobs); "
                                 "leave it unset")
        return BeamSearchParams(
            beam_width=self.n,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            length_penalty=self.length_penalty,
            ignore_eos=self.ignore_eos,
            early_stopping=self.early_stopping,
        )

    def unsupported(self) -> tuple[str, str] | None:
        if not self.use_beam_search and (self.length_penalty != 1.0 or self.early_stopping is not False):
            name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
            return name, f"{name} applies only to beam search (use_beam_search: true)"
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if (self.model_extra or {}).get(name) not in (None, [], "none"):
                return name, f"{name}: tool calling is served on /v1/chat/completions, not on completions"
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


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field("{}", max_length=MAX_SPEC_CHARS)

    @field_validator("arguments")
    @classmethod
    def _nesting(cls, value: str) -> str:
        # JSON text the chat template parses and walks: as deep as a body may be, no deeper
        if is_nested_too_deeply(value):
            raise ValueError(f"tool call arguments: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return value


class ToolCall(_Body):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    # OpenAI's roles, or any other name a model's template knows (vLLM passes custom roles through)
    role: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (tool-call arguments as objects where they parse)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _maybe_json(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _maybe_json(text: str) -> Any:
    try:
        return loads_bounded(text, "tool call arguments")
    except ValueError:  # not JSON, or nested too deeply to walk: the text as it came
        return text


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the template's own variables (Qwen3's enable_thinking...), vLLM's extension; reasoning_effort
    # reaches templates that read it (gpt-oss) under that name
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template: str | None = Field(None, max_length=MAX_SPEC_CHARS)  # only with --trust-request-chat-template
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    include_reasoning: bool = True  # vLLM's: False drops reasoning_content from the answer
    echo: bool = False  # vLLM's: the answer starts with the last message's text when it is the assistant's

    def template_kwargs(self) -> dict[str, Any]:
        """What goes to the chat template beside the messages; ValueError naming a reserved key."""
        out = dict(self.chat_template_kwargs or {})
        for key in out:
            if key in RESERVED_TEMPLATE_KEYS or key.startswith("_"):
                raise ValueError(f"chat_template_kwargs: {key!r} is set by the server, not by a request")
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        if self.continue_final_message:
            out["continue_final_message"] = True
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out

    def plain_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]

    def unsupported(self) -> tuple[str, str] | None:
        extra = self.model_extra or {}
        if extra.get("use_beam_search"):
            return "use_beam_search", "use_beam_search is not supported on chat completions (use /v1/completions)"
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            return "continue_final_message", ("continue_final_message needs add_generation_prompt: false and an "
                                               "assistant message last (the one continued)")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools ({', '.join(names)})"
        return super().unsupported()


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    # vLLM's: whether a prompt gets the tokenizer's special tokens (BOS...); lm-eval sends false.
    # A conversation's come from its chat template.
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: each token's vocabulary entry too
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    continue_final_message: bool = False  # vLLM's: the last (assistant) message left open

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
