"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages request becomes a chat request (system, messages with text / tool_use / tool_result /
thinking blocks, tools with input_schema, tool_choice auto/any/tool/none, stop_sequences,
temperature/top_p/top_k, `thinking` as the template's enable_thinking); its answer is written back
as content blocks (thinking, text, tool_use) with Anthropic's stop reasons and usage, whole or as
Anthropic's event stream (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors are in Anthropic's shape (app.py picks it by path)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field

from octavo.request import CompletionOutput, RequestOutput
from octavo.server.chat import PreparedChat, forced_calls, prepare_chat
from octavo.server.core import APIError, OpenAIServer
from octavo.server.generation import collect_all, guarded_stream, stream_error, submitted
from octavo.server.guard import anthropic_error_body
from octavo.server.parsers.tool_calls import ParsedCall
from octavo.server.parsers.turn import TurnStream
from octavo.server.protocol import INT32_MAX, MAX_MESSAGES, MAX_TOOLS, MAX_USER_CHARS, _Body, \
    ChatCompletionRequest

MAX_STOP_SEQUENCES = 16


class Block(_Body):
    """A content block of any type this route reads; the type decides which fields count."""

    type: str
    text: str | None = None
    id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, max_length=256)
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(None, max_length=8192)
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web_search...) are refused


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=64)
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, le=INT32_MAX)


class MessagesRequest(_Body):
    """Anthropic's Messages body. A field it does not declare is refused by name (extra="forbid"),
    as Anthropic refuses it: OpenAI's fields sent here (response_format, n, logit_bias...) were
    accepted and ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None
    # Anthropic's structured outputs: {"format": {"type": "json_schema", "schema": {...}}}
    output_config: dict[str, Any] | None = None
    # the same extensions the chat route takes, for clients that send them here
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=64)
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either is served the same


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1, le=INT32_MAX)  # not part of a count_tokens body


def _text_of(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        if block.type != "text":
            raise APIError(400, f"{where}: content blocks of type {block.type!r} are not supported here; only 'text'",
                           "invalid_request_error", where)
        parts.append(_block_text(block, where))
    return "".join(parts)


def _block_text(block: Block, where: str) -> str:
    if block.text is None:
        raise APIError(400, f"{where}: a text block needs a 'text' string", "invalid_request_error", where)
    return block.text


def _chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool results become `tool` messages (before the user's
    text, where Anthropic puts them), tool_use blocks an assistant's tool_calls, thinking its
    reasoning_content."""
    out: list[dict[str, Any]] = []
    system = _text_of(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for k, m in enumerate(req.messages):
        where = f"messages.{k}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, reasoning, results = [], [], [], []
        for block in m.content:
            if block.type == "text":
                text.append(_block_text(block, where))
            elif block.type == "tool_use" and m.role == "assistant":
                if not block.id or not block.name:
                    raise APIError(400, f"{where}: a tool_use block needs an id and a name", "invalid_request_error", where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
            elif block.type == "tool_result" and m.role == "user":
                if not block.tool_use_id:
                    raise APIError(400, f"{where}: a tool_result block needs tool_use_id", "invalid_request_error", where)
                body = _text_of(block.content, where)
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": f"Error: {body}" if block.is_error else body})
            elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                reasoning.append(block.thinking or "")
            else:
                raise APIError(400, f"{where}: content blocks of type {block.type!r} are not supported in a "
                                    f"{m.role} message here", "invalid_request_error", where)
        out.extend(results)
        if text or calls or reasoning or not results:
            message: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            out.append(message)
    return out


def as_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means (400 for what it cannot carry)."""
    for tool in req.tools or []:
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools: server tools ({tool.type}) are not run by this server; give custom tools "
                                "with input_schema", "invalid_request_error", "tools")
    for stop in req.stop_sequences or []:
        if not 1 <= len(stop) <= 1024:
            raise APIError(400, "stop_sequences: each must be 1 to 1024 characters", "invalid_request_error", "stop_sequences")
    choice = req.tool_choice
    tool_choice: Any = None
    if choice is not None and choice.type in ("any", "tool") and not req.tools:
        raise APIError(400, f"tool_choice: type {choice.type!r} needs tools", "invalid_request_error", "tool_choice")
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice: type 'tool' needs a name", "invalid_request_error", "tool_choice")
            tool_choice = {"type": "function", "function": {"name": choice.name}}
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:  # where the template has the switch (Qwen3's enable_thinking)
        template_kwargs.setdefault("enable_thinking", req.thinking.type != "disabled")
    body: dict[str, Any] = {
        "model": req.model, "messages": _chat_messages(req), "max_tokens": req.max_tokens, "stream": req.stream,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_sequences or None,
        "seed": req.seed, "priority": req.priority, "cache_salt": req.cache_salt,
        "chat_template_kwargs": template_kwargs or None,
        "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
    }
    if req.tools and tool_choice != "none":
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
        body["tool_choice"] = tool_choice
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format: give {\"type\": \"json_schema\", \"schema\": {...}}",
                           "invalid_request_error", "output_config")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    user = (req.metadata or {}).get("user_id")
    if isinstance(user, str):
        body["user"] = user[:MAX_USER_CHARS]
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as exc:
        raise APIError(400, f"the request cannot be served: {str(exc).splitlines()[0]}", "invalid_request_error") from exc


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(call: ParsedCall) -> dict[str, Any]:
    try:
        value = json.loads(call.arguments)
    except ValueError:  # arguments cut by max_tokens
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(c: CompletionOutput, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(server: OpenAIServer, chat: PreparedChat, out: RequestOutput | None, num_output: int) -> dict[str, Any]:
    """Anthropic's usage. With --enable-prompt-tokens-details (off by default: it tells a tenant
    what is cached) the prompt is split as Anthropic counts it: read from the cache, written to it
    (the full blocks computed now), and the rest (input_tokens); the three add up to the prompt."""
    num_prompt = len(chat.ids)
    if not server.limits.enable_prompt_tokens_details or out is None:
        return {"input_tokens": num_prompt, "output_tokens": num_output}
    block = server.engine.config.cache.block_size
    read = min(out.num_cached_tokens, num_prompt)
    created = max(0, num_prompt // block * block - read)
    return {"input_tokens": num_prompt - read - created, "output_tokens": num_output,
            "cache_read_input_tokens": read, "cache_creation_input_tokens": created}


class BlockWriter:
    """One answer's content blocks, from its output pieces; `feed` returns the stream events for a
    piece (and `blocks` holds the whole answer's blocks)."""

    def __init__(self, server: OpenAIServer, chat: PreparedChat) -> None:
        self.chat = chat
        self.turn = TurnStream(server.reasoning, chat.starts_in_reasoning, chat.calls if chat.mode == "auto" else None,
                               chat.schemas, None if chat.req.parallel_tool_calls else 1)
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the last block while it is open
        self._forced = ""  # "required" / named: the constrained JSON so far
        self.has_calls = False

    def _start(self, block: dict[str, Any], events: list[tuple[str, dict]]) -> None:
        self._close(events)
        self.blocks.append(block)
        events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": dict(block)}))
        self._open = block["type"]

    def _close(self, events: list[tuple[str, dict]]) -> None:
        if self._open is not None:
            events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
            self._open = None

    def _delta(self, kind: str, field: str, text: str, events: list[tuple[str, dict]]) -> None:
        if field in self.blocks[-1]:
            self.blocks[-1][field] += text
        events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                               "delta": {"type": kind, field: text}}))

    def _call(self, call: ParsedCall, events: list[tuple[str, dict]]) -> None:
        self.has_calls = True
        self._start({"type": "tool_use", "id": _tool_id(), "name": call.name, "input": {}}, events)
        self.blocks[-1]["input"] = _input(call)  # whole in the answer; streamed as JSON text
        self._delta("input_json_delta", "partial_json", call.arguments, events)
        self._close(events)

    def feed(self, text: str, finished: bool, complete: bool) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        piece = self.turn.feed(text, finished)  # a forced call is the answer after any reasoning
        if piece.reasoning:
            if self._open != "thinking":
                self._start({"type": "thinking", "thinking": "", "signature": ""}, events)
            self._delta("thinking_delta", "thinking", piece.reasoning, events)
        if self.chat.mode in ("required", "named"):
            self._forced += piece.content
            if finished:
                for call in forced_calls(self._forced, self.chat.tool_choice, complete):
                    self._call(call, events)
                self._close(events)
            return events
        if piece.content and (self._open == "text" or piece.content.strip()):
            if self._open != "text":
                self._start({"type": "text", "text": ""}, events)
            self._delta("text_delta", "text", piece.content, events)
        for call in piece.calls:
            self._call(call, events)
        if finished:
            self._close(events)
        return events

    def content(self) -> list[dict[str, Any]]:
        out = []
        for block in self.blocks:
            if block["type"] == "text" and self.has_calls:
                block = {**block, "text": block["text"].strip()}
                if not block["text"]:
                    continue
            out.append(block)
        return out


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _message(server: OpenAIServer, msg_id: str, content: list[dict], reason: str | None, sequence: str | None,
             usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": server.model_name, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Any:
        chat = await prepare_chat(server, as_chat_request(req))
        async with server.grammar_held(chat.params.structured_outputs, chat.constraint_param, request):
            async with submitted(server, request, [chat.ids], chat.params, chat.req.priority, chat.req.cache_salt,
                                 chat.lora, "msg", one_id=True) as sub:
                msg_id = f"msg_{sub.rid.split('-', 1)[1]}"
                if req.stream:
                    pieces = _stream_events(server, chat, msg_id, sub.collector)
                    body = guarded_stream(server, sub, pieces, _stream_error)
                    return StreamingResponse(body, media_type="text/event-stream")
                items = await collect_all(server, sub)
        out = items[0]
        c = out.outputs[0]
        writer = BlockWriter(server, chat)
        writer.feed(c.text, True, c.finish_reason == "stop")
        reason, sequence = stop_reason(c, writer.has_calls)
        return _message(server, msg_id, writer.content(), reason, sequence, _usage(server, chat, out, len(c.token_ids)))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest, request: Request) -> Any:
        chat = await prepare_chat(server, as_chat_request(req))
        return {"input_tokens": len(chat.ids)}

    return router


def _stream_error(exc: Exception) -> list[str]:
    status, message, _ = stream_error(exc)
    return [_sse("error", anthropic_error_body(status, message))]


async def _stream_events(server: OpenAIServer, chat: PreparedChat, msg_id: str, collector: Any) -> AsyncIterator[str]:
    yield _sse("message_start", {"type": "message_start", "message": _message(
        server, msg_id, [], None, None, {"input_tokens": len(chat.ids), "output_tokens": 0})})
    yield _sse("ping", {"type": "ping"})
    writer = BlockWriter(server, chat)
    num_tokens, last = 0, None
    while batch := await collector.next_batch():
        for _, out in batch:
            c = out.outputs[0]
            num_tokens += len(c.token_ids)
            last = (out, c)
            for event, data in writer.feed(c.text, c.finish_reason is not None, c.finish_reason == "stop"):
                yield _sse(event, data)
    if last is None:
        return
    out, c = last
    reason, sequence = stop_reason(c, writer.has_calls)
    usage = _usage(server, chat, out, num_tokens)
    yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage})
    yield _sse("message_stop", {"type": "message_stop"})
