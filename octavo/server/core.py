"""What the route families share: the server's state (engine, tokenizer, limits, thread pool),
API errors, request checks, and the disconnect watch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from octavo.chat_template.isolated import TemplateRenderer
from octavo.chat_template.sandbox import RenderBudget
from octavo.lora.request import LoRARequest
from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.params import MAX_LOGPROBS, PoolingParams, StructuredOutputsParams
from octavo.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStopped,
    LoRANotLoadedError,
)
from octavo.server.parsers.reasoning import ReasoningFormat, prompt_opens_reasoning, reasoning_format
from octavo.server.parsers.tool_calls import CallFormat, call_format
from octavo.server.protocol import new_id
from octavo.server.tools import render_tool_calls_as_text, tools_system_prompt
from octavo.structured.isolated import DEFAULT_COMPILE_TIMEOUT_S, GrammarQueueFull, IsolatedCompiler
from octavo.structured.manager import GrammarCacheFull, GrammarError
from octavo.tokenizer import encode_prompt


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


_PARAM_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logprobs", "stop_token_ids", "stop", "seed", "n",
                "cache_salt", "stream", "length_penalty", "early_stopping", "logit_bias", "prompt_logprobs",
                "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "echo")


def param_of(message: str) -> str | None:
    """The request field a validation message is about: the one it starts with, else one it names
    after a colon near its start."""
    starts = [p for p in _PARAM_NAMES if message.startswith(p)]
    if starts:
        return max(starts, key=len)
    return next((p for p in _PARAM_NAMES if f": {p}" in message[:40]), None)


GENERATION_DEFAULT_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one request may ask for; see docs/RELIABILITY.md."""

    max_request_bytes: int = 4 << 20
    retry_after_s: int = 1
    enable_prompt_tokens_details: bool = False
    enable_debug_endpoints: bool = False
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    tool_call_parser: str | None = None  # how tool_choice "auto" reads the model's calls (parsers/tool_calls.py)
    reasoning_parser: str | None = None  # how reasoning is split from the answer (parsers/reasoning.py)
    trust_request_chat_template: bool = False  # a request may send its own chat_template (vLLM's flag)
    runner: str = "auto"  # "generate", "pooling" (embeddings, rerank, score only) or "auto" (both)
    return_tokens_as_token_ids: bool = False  # logprob tokens named "token_id:<id>" by default (vLLM's flag)
    enable_force_include_usage: bool = False  # every stream ends with usage, asked or not (vLLM's flag)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / top_logprobs / prompt_logprobs a request may ask
    enable_request_id_headers: bool = False  # answers carry X-Request-Id (vLLM's flag)
    root_path: str = ""  # a proxy's path prefix: routes answer with and without it
    # vLLM's --override-generation-config: defaults for what a request leaves unset
    # (max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty)
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    pooling_type: str = "last"  # how /v1/embeddings, rerank and score pool the final hidden states
    matryoshka: bool = False  # the model's embeddings may be cut to `dimensions` (trained for it)
    max_stored_responses: int = 1024  # /v1/responses kept for previous_response_id (oldest dropped)
    max_stored_response_bytes: int = 128 << 20  # ... and their JSON together at most this large
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # a constraint not compiled by then: 400
    chat_template_timeout_s: float = 10.0  # a chat template not rendered by then: 400 (its worker replaced)
    header_timeout_s: float = 30.0  # a request's head (and each pause in its body) must come within this
    dashboard_interval_s: float = 0.25  # the dashboard builds at most one snapshot per interval (4 a second)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            call_format(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)
        unknown = sorted(set(dict(self.generation_defaults)) - set(GENERATION_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(GENERATION_DEFAULT_KEYS)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"--runner must be auto, generate or pooling, got {self.runner!r}")
        PoolingParams(self.pooling_type)  # ValueError naming the choices
        if not 0.01 <= self.dashboard_interval_s <= 60:
            raise ValueError(f"--dashboard-interval must be between 0.01 and 60 seconds, got {self.dashboard_interval_s}")
        for flag, value, low, high in (
            ("--max-request-bytes", self.max_request_bytes, 1024, 1 << 40),
            ("--max-stored-responses", self.max_stored_responses, 0, 1 << 24),
            ("--max-stored-response-bytes", self.max_stored_response_bytes, 0, 1 << 40),
            ("--grammar-compile-timeout", self.grammar_compile_timeout_s, 0.01, 3600.0),
            ("--chat-template-timeout", self.chat_template_timeout_s, 0.01, 3600.0),
            ("--header-timeout", self.header_timeout_s, 0.1, 3600.0),
        ):
            if not low <= value <= high:  # NaN fails too
                raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


class OpenAIServer:
    """Holds what the routes share: the engine, tokenizer, model name, limits and the thread pool
    that keeps tokenisation, chat templating and logprob decoding off the event loop."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
                 limits: ServerLimits | None = None, aliases: list[str] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.aliases = frozenset(aliases or ())  # other names the base model is served under
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        config = engine.config
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.priority_enabled = config.scheduler.policy in ("priority", "cache-aware")
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="octavo-tokenize")
        self.grammars = IsolatedCompiler(engine.grammar_cache, self.limits.grammar_compile_timeout_s)
        # chat templates render in worker processes with a budget (chat_template/isolated.py); the
        # longest text one may write: what the largest request body could hold, four times over
        self.templates = TemplateRenderer(RenderBudget(self.limits.chat_template_timeout_s,
                                                       max_chars=max(1 << 20, 4 * self.limits.max_request_bytes)))
        # adapters by the name a request's `model` field selects (kept in step with the engine)
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in engine.list_loras()}
        self._token_text: dict[int, str] = {}
        # OpenAI's system_fingerprint: the backend configuration an answer came from (Octavo's
        # version, the weights' quantization and activation dtype); it changes when they do
        import hashlib

        import octavo

        backend = f"{octavo.__version__}|{config.quantization}|{config.activation_dtype}|{config.dtype}"
        self.system_fingerprint = "fp_" + hashlib.sha256(backend.encode()).hexdigest()[:10]
        self.tool_calls: CallFormat | None = (call_format(self.limits.tool_call_parser)
                                              if self.limits.tool_call_parser else None)
        self.reasoning: ReasoningFormat | None = (reasoning_format(self.limits.reasoning_parser)
                                                  if self.limits.reasoning_parser else None)
        self._max_chars_per_token: int | None = None

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name or model in self.aliases:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *self.loras])
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           "NotFoundError", "model")
        return lora

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """A chat's max_tokens when the request sets none: what the context has room for, or
        --override-generation-config's max_new_tokens if smaller."""
        room = self.max_model_len - num_prompt_tokens
        asked = dict(self.limits.generation_defaults).get("max_new_tokens")
        return room if asked is None else max(1, min(room, int(asked)))

    def with_generation_defaults(self, req: Any) -> Any:
        """The request with --override-generation-config's sampling defaults where it sets none."""
        defaults = {k: v for k, v in self.limits.generation_defaults if k != "max_new_tokens"
                    and getattr(req, k, None) is None}
        return req.model_copy(update=defaults) if defaults else req

    def check_runner(self, kind: str) -> None:
        """400 for a generation route on a pooling-only server, or a pooling route on a
        generation-only one (--runner)."""
        if self.limits.runner not in ("auto", kind):
            served = ("/v1/embeddings, /v1/rerank and /score" if self.limits.runner == "pooling"
                      else "generation (completions, chat, responses, messages)")
            raise APIError(400, f"this server runs with --runner {self.limits.runner}: it serves {served} only",
                           "BadRequestError", "model")

    def truncate_prompt(self, ids: list[int], keep: int | None, side: str = "left") -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (side "left": the start is
        cut; "right": its first `keep`); -1: the context length's worth; None leaves it whole."""
        if keep is None:
            return ids
        keep = self.max_model_len - 1 if keep == -1 else keep
        if not keep:
            return []
        return ids[-keep:] if side == "left" else ids[:keep]

    def check_request(self, req: Any) -> LoRARequest | None:
        """Checks a request's fields; returns the LoRA adapter its `model` selects, if any."""
        self.check_runner("generate")
        lora = self.check_model(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], "BadRequestError", bad[0])
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if not isinstance(value, bool) and isinstance(value, int) and value > self.limits.max_logprobs:
                raise APIError(400, f"{name}: at most {self.limits.max_logprobs} (this server's --max-logprobs), "
                                    f"got {value}", "BadRequestError", name)
        if req.priority != 0 and not self.priority_enabled:
            raise APIError(400, "priority needs a server started with --scheduling-policy priority (or cache-aware)",
                           "BadRequestError", "priority")
        return lora

    def check_prompt_len(self, ids: list[int]) -> None:
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(ids)} tokens; at least one output token must fit.", "BadRequestError", "prompt")

    @property
    def max_chars_per_token(self) -> int:
        """No token decodes to more characters than its vocabulary entry has (byte-level entries
        spell each byte with one character), so a prompt longer than max_model_len times the
        longest entry cannot fit and is refused without tokenising it. Read from the vocabulary
        on first need (0.15-0.3 s for 128k-262k entries: not at start)."""
        if self._max_chars_per_token is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_chars_per_token = max((len(t) for t in vocab), default=64) + 1
        return self._max_chars_per_token

    def check_text_len(self, text: str) -> None:
        # (every bound is at least 2 characters a token: a text of max_model_len characters fits it)
        if len(text) > self.max_model_len and len(text) > self.max_model_len * self.max_chars_per_token:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                                f"has {len(text)} characters, more than that many tokens can hold.",
                           "BadRequestError", "prompt")

    # ---- off-loop work -----------------------------------------------------------------------

    async def encode(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                self.check_text_len(p)
                out.append(await self.off_loop(encode_prompt, self.tokenizer, p, add_special_tokens))
            else:
                if not all(0 <= t < self.vocab_size for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", "BadRequestError", "prompt")
                out.append(list(p))
        return out

    @property
    def template_renders_tools(self) -> bool:
        """Whether the model's chat template writes `tools` itself; when it does not, Octavo writes
        them as Hermes' instructions, and reads the model's calls as Hermes' blocks."""
        return "tool" in (getattr(self.tokenizer, "chat_template", None) or "")

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                          add_special_tokens: bool = False) -> list[int]:
        """Token ids of the conversation through the model's chat template. `tools` (and tool calls
        in assistant messages) go to a template that renders them; for one that does not, they are
        written as Hermes' system prompt and <tool_call> blocks. `template_kwargs`: the template's
        variables (chat_template_kwargs) and continue_final_message / a request's chat_template."""
        self.check_text_len("".join(str(m.get("content") or "") + str(m.get("tool_calls") or "") for m in messages))
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if self.template_renders_tools or kwargs.get("chat_template"):
            if tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        else:
            messages = [render_tool_calls_as_text(m) if m.get("tool_calls") else m for m in messages]
            if tools:
                system = tools_system_prompt(tools)
                if messages and messages[0]["role"] == "system":
                    messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + system}, *messages[1:]]
                else:
                    messages = [{"role": "system", "content": system}, *messages]
        request_template = kwargs.pop("chat_template", None)
        source = request_template or getattr(self.tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            raise APIError(400, "this model has no chat template: start the server with --chat-template FILE, "
                                "or send prompts to /v1/completions", "BadRequestError", "messages")
        continue_final = bool(kwargs.pop("continue_final_message", False))
        tools_json = kwargs.pop("tools", None)
        variables = {**(getattr(self.tokenizer, "special_tokens_map", None) or {}), **kwargs}
        param = "chat_template" if request_template else "messages"
        try:
            text = await self.templates.render(source, messages, tools_json, add_generation_prompt, variables,
                                               continue_final, from_request=request_template is not None)
        except Exception as exc:  # TemplateBudgetError names the bound; otherwise the template's own error
            raise APIError(400, f"could not apply the chat template: {exc}", "BadRequestError", param) from exc
        self.check_text_len(text)
        return await self.off_loop(encode_prompt, self.tokenizer, text, add_special_tokens)

    def auto_tool_format(self) -> CallFormat | None:
        """How tool_choice "auto" reads the model's calls: --tool-call-parser's format; else Hermes'
        where Octavo wrote the tools as Hermes' instructions itself (the template does not render
        tools); else None (the template writes tools in a format only a parser flag names)."""
        if self.tool_calls is not None:
            return self.tool_calls
        return None if self.template_renders_tools else call_format("hermes")

    def reasoning_ended(self, ids: list[int]) -> bool:
        """Whether the rendered prompt already closed the reasoning (a template with thinking off
        writes an empty <think></think>): the answer is all the output then."""
        if self.reasoning is None:
            return True
        tail = self.tokenizer.decode(ids[-32:])
        end = tail.rfind(self.reasoning.end)
        return end != -1 and end > tail.rfind(self.reasoning.start)

    def prompt_opens_reasoning(self, ids: list[int]) -> bool:
        """Whether the rendered prompt ends inside an open reasoning block (see parsers/reasoning.py)."""
        if self.reasoning is None:
            return False
        return prompt_opens_reasoning(self.reasoning, self.tokenizer.decode(ids[-8:]))

    @contextlib.asynccontextmanager
    async def grammar_held(self, constraint: StructuredOutputsParams | None, param: str,
                           request: Request) -> AsyncIterator[None]:
        """Compile a request's output constraint (in a child process with a deadline, unless
        cached) and hold it in the engine's grammar cache for the body, which adds the request
        (the engine then holds it until the request ends). 400 naming `param` if it cannot be
        used; 429 if the grammars of requests in flight fill the cache; 499 if the client leaves
        while it compiles (the compile is stopped)."""
        if constraint is None:
            yield
            return
        manager = self.engine.grammar_cache
        holder = new_id("grammar")
        try:
            grammar = manager.lookup(constraint)
            if grammar is None:
                # a fair turn per client: by connection (its queue of new schemas waits behind every
                # other client's next one, never in front of it)
                client = f"{request.client.host}:{request.client.port}" if request.client else ""
                task = asyncio.ensure_future(self.grammars.compile(constraint, client))
                async with DisconnectWatch(request, task.cancel) as watch:
                    try:
                        grammar = await task
                    except asyncio.CancelledError:
                        if not watch.disconnected:
                            raise
                        raise APIError(499, "client disconnected", "ClientClosedRequest") from None
            manager.insert(constraint, grammar, holder=holder)
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", "BadRequestError", param) from exc
        except (GrammarCacheFull, GrammarQueueFull) as exc:
            raise APIError(429, str(exc), "RateLimitError", param,
                           headers={"Retry-After": str(self.limits.retry_after_s)}) from exc
        try:
            yield
        finally:
            manager.release(holder)

    def logprob_token(self, token_id: int, as_ids: bool) -> str:
        """A logprob entry's token: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def tokens_as_ids(self, req: Any) -> bool:
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.limits.return_tokens_as_token_ids if asked is None else asked

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# ---- disconnects ---------------------------------------------------------------------------


class DisconnectWatch:
    """While open, a task waits for the client's http.disconnect and then calls `on_disconnect`
    (which aborts the request's engine work). Used for the whole life of a request that is not
    streaming yet: queued, prefilling, or collecting a non-streamed answer."""

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self.request, self.on_disconnect = request, on_disconnect
        self.disconnected = False
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self.on_disconnect()
                return

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)




def engine_error(exc: Exception, limits: ServerLimits) -> APIError:
    """The HTTP error of an exception from AsyncEngine.add or a collector."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "RateLimitError", headers={"Retry-After": str(limits.retry_after_s)})
    if isinstance(exc, (EngineStopped, EngineDeadError)):
        return APIError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, LoRANotLoadedError):
        return APIError(404, str(exc), "NotFoundError", "model")
    return APIError(400, str(exc), "BadRequestError", param_of(str(exc)) or "prompt")


def sampling_params(req: Any, default_max_tokens: int, logprobs: int | None) -> Any:
    """The request's SamplingParams; 400 naming the field when a value is refused."""
    try:
        return req.to_sampling_params(default_max_tokens, logprobs)
    except ValueError as exc:
        param = param_of(str(exc))
        if param == "structured_outputs":  # StructuredOutputsParams' words, whichever field carried the constraint
            param = req.structured_param()
            raise APIError(400, f"{param}: {exc}", "BadRequestError", param) from exc
        raise APIError(400, str(exc), "BadRequestError", param) from exc


def vllm_prompt_logprobs(server: OpenAIServer, lps: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, decoded_token}}
    for the prompt's own token and its top alternatives."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "decoded_token": server.token_text(t)} for t, v in lp.top.items()}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "decoded_token": server.token_text(lp.token_id)}
        out.append(entry)
    return out
