"""POST /v1/responses (OpenAI's Responses API), GET /v1/responses/{id} and POST
/v1/responses/{id}/cancel: text, message, function_call and function_call_output input items,
instructions, function tools (tool_choice auto / required / none / a named function, read as
chat's tool calls), reasoning items (with --reasoning-parser), max_output_tokens, text.format
through structured outputs, include message.output_text.logprobs, background responses
(queued -> in_progress -> completed / cancelled), streamed events in the official shape, and
previous_response_id from a bounded in-memory store. A request becomes a chat request
(octavo/server/chat.py) and its answer output items. Not covered (400): built-in tools,
conversation objects, prompt templates; see docs/API.md."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from octavo.request import CompletionOutput, RequestOutput
from octavo.sampling.logprobs import TokenLogprob
from octavo.server.async_engine import EngineDeadError, EngineOverloadedError, EngineStopped
from octavo.server.chat import PreparedChat, forced_calls, prepare_chat
from octavo.server.core import APIError, OpenAIServer, engine_error
from octavo.server.generation import collect, collect_all, guarded_stream, stream_error, submitted
from octavo.server.guard import error_body
from octavo.server.parsers.tool_calls import ParsedCall
from octavo.server.parsers.turn import TurnStream
from octavo.server.protocol import (INT32_MAX, MAX_LOGPROBS, MAX_MESSAGES, MAX_TOOLS, MAX_USER_CHARS,
                                    ChatCompletionRequest, _Body, new_id, now)

# OpenAI's limits on metadata: 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
PASSED_SAMPLING_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                          "stop", "min_tokens", "chat_template_kwargs", "skip_special_tokens")


class InputContent(_Body):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


class InputItem(_Body):
    """An input item: a message (the default type), a function call and its output, or reasoning."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=64)
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    id: str | None = Field(None, max_length=256)
    summary: list[InputContent] | None = None

    def text(self) -> str:
        value = self.content if self.type != "function_call_output" else self.output
        if value is None or isinstance(value, str):
            return value or ""
        return "".join(c.text for c in value)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_body: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat = TextFormat()


class FunctionTool(_Body):
    type: str
    name: str | None = Field(None, max_length=64)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    # a string is bounded by the prompt-length limits (checked when it is tokenised), a list by its
    # item count
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = Field(None, max_length=16)
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_key: str | None = Field(None, max_length=1024)  # accepted; `octavo router` routes by it

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                                 f"{MAX_METADATA_VALUE_CHARS}; {key[:40]!r} is over")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        for tool in self.tools or []:
            if tool.type != "function":
                return "tools", (f"tools: built-in tools ({tool.type}) are not run by this server; give function tools "
                                 "(type 'function')")
            if not tool.name:
                return "tools", "tools: a function tool needs a name"
        if self.truncation == "auto":
            return "truncation", "truncation: only 'disabled' is supported (a too-long input is refused)"
        for item in self.include or []:
            if item != LOGPROBS_INCLUDE:
                return "include", f"include: only {LOGPROBS_INCLUDE!r} is supported by this server, not {item!r}"
        if self.background and not self.store:
            return "background", ("background: background can only be used when `store` is true (the response is "
                                  "fetched by its id)")
        if self.background and self.stream:
            return "background", "background: not combined with stream here; poll GET /v1/responses/{id}"
        for name in ("conversation", "prompt"):
            if (self.model_extra or {}).get(name) not in (None, False, [], {}):
                return name, f"{name}: not supported on /v1/responses by this server"
        if (self.model_extra or {}).get("service_tier") not in (None, "auto", "default"):
            return "service_tier", "service_tier: only auto/default"
        return self.refused_extra(PASSED_SAMPLING_FIELDS)  # chat_template_kwargs among them: read here

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None


class ResponseStore:
    """The last stored responses (their body and the conversation they end), at most `capacity` of
    them and `max_bytes` of memory together: oldest dropped first. Each is kept as compact JSON
    bytes and parsed again when read, so what it costs is what is counted: kept as Python dicts, a
    logprob-heavy response took ~5x its JSON's length (96 under a 16 MiB bound grew the server by
    85 MiB). A conversation is counted whole in each response that ends it. A response larger than
    `max_bytes` alone is not stored."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[bytes, bytes, int]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> bool:
        """Store it (True), dropping the oldest to make room; False if it alone is too large."""
        encoded = (_compact(body), _compact(conversation))
        size = sum(sys.getsizeof(b) for b in encoded)  # the memory the two bytes objects hold
        if size > self.max_bytes:
            return False
        old = self._items.pop(body["id"], None)  # a background response, stored again as it progresses
        if old is not None:
            self.num_bytes -= old[2]
        self._items[body["id"]] = (*encoded, size)
        self.num_bytes += size
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._items.popitem(last=False)[1][2]
        return True

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """(body, conversation), parsed afresh: the caller's to change."""
        found = self._items.get(response_id)
        return None if found is None else (json.loads(found[0]), json.loads(found[1]))

    def __len__(self) -> int:
        return len(self._items)


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def as_chat_messages(req: ResponsesRequest, history: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the messages the model sees: instructions, history, this turn; this turn's messages, which
    the store keeps) in chat's form. Consecutive function_call items become one assistant message's
    tool_calls; function_call_output items tool messages; reasoning items are dropped (templates
    drop earlier turns' reasoning)."""
    if isinstance(req.input, str):
        turn: list[dict] = [{"role": "user", "content": req.input}]
    else:
        turn = []
        for k, item in enumerate(req.input):
            if item.type == "message":
                if item.role is None:
                    raise APIError(400, f"input.{k}: a message needs a role", "BadRequestError", "input")
                turn.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif item.type == "function_call":
                if not item.call_id or not item.name:
                    raise APIError(400, f"input.{k}: a function_call needs call_id and name", "BadRequestError", "input")
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if turn and turn[-1]["role"] == "assistant" and turn[-1].get("tool_calls") is not None:
                    turn[-1]["tool_calls"].append(call)
                else:
                    turn.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                if not item.call_id:
                    raise APIError(400, f"input.{k}: a function_call_output needs call_id", "BadRequestError", "input")
                turn.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + history + turn, turn


def as_chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "priority": req.priority,
                            "cache_salt": req.cache_salt, "user": req.user}
    for name in PASSED_SAMPLING_FIELDS:  # vLLM's extra sampling fields, as chat takes them
        if (req.model_extra or {}).get(name) is not None:
            body[name] = req.model_extra[name]
    if req.wants_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_body is None:
            raise APIError(400, "text.format: type json_schema needs a schema", "BadRequestError", "text")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                          "schema": fmt.schema_body}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in req.tools]
        choice = req.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        body["tool_choice"] = choice
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    elif req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice: needs tools", "BadRequestError", "tool_choice")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValueError as exc:
        raise APIError(400, f"the request cannot be served: {str(exc).splitlines()[0]}", "BadRequestError") from exc


def _logprob_entries(server: OpenAIServer, lps: list[TokenLogprob] | None) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = server.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in (lp.top or {}).items()]}
            for lp in lps or []]


class ItemWriter:
    """One answer's output items from its pieces: reasoning, the message, function calls; `feed`
    returns the stream events for a piece (unnumbered: (kind, fields)), `items` holds the answer's."""

    def __init__(self, server: OpenAIServer, chat: PreparedChat, eager_message: bool) -> None:
        self.server, self.chat = server, chat
        self.turn = TurnStream(server.reasoning, chat.starts_in_reasoning, chat.calls if chat.mode == "auto" else None,
                               chat.schemas, None if chat.req.parallel_tool_calls else 1)
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item still open
        self._forced = ""
        self.calls: list[ParsedCall] = []
        self.eager_message = eager_message

    def _start(self, item: dict, events: list) -> None:
        self._close(events)
        self.items.append(item)
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": _copy(item, "in_progress")}))
        if item["type"] == "message":
            events.append(("response.content_part.added", {**self._part(), "part": _text_part("")}))
        self._open = item if item["type"] != "function_call" else None

    def _part(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, events: list) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        if item["type"] == "message":
            part = item["content"][0]
            events.append(("response.output_text.done", {**self._part(), "text": part["text"], "logprobs": part["logprobs"]}))
            events.append(("response.content_part.done", {**self._part(), "part": part}))
        else:
            text = item["content"][0]["text"]
            events.append(("response.reasoning_text.done", {**self._part(), "text": text}))
        events.append(("response.output_item.done", {"output_index": len(self.items) - 1, "item": item}))

    def _text(self, text: str, lps: list[dict], events: list) -> None:
        if self._open is None or self._open["type"] != "message":
            self._start({"id": new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                         "content": [_text_part("")]}, events)
        part = self.items[-1]["content"][0]
        part["text"] += text
        part["logprobs"].extend(lps)
        events.append(("response.output_text.delta", {**self._part(), "delta": text, "logprobs": lps}))

    def _call(self, call: ParsedCall, events: list) -> None:
        self.calls.append(call)
        item = {"id": new_id("fc"), "type": "function_call", "status": "completed" if call.complete else "incomplete",
                "call_id": call.id,
                "name": call.name, "arguments": call.arguments}
        self._start(item, events)
        index = len(self.items) - 1
        events.append(("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                  "delta": call.arguments}))
        events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                 "arguments": call.arguments}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))

    def open_eagerly(self) -> list:
        events: list = []
        if self.eager_message:
            self._text("", [], events)
            events = [e for e in events if e[0] != "response.output_text.delta"]
        return events

    def feed(self, c: CompletionOutput, lps: list[dict]) -> list:
        events: list = []
        finished = c.finish_reason is not None
        piece = self.turn.feed(c.text, finished)  # a forced call is the answer after any reasoning
        if piece.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                self._start({"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "completed",
                             "content": [{"type": "reasoning_text", "text": ""}]}, events)
            self.items[-1]["content"][0]["text"] += piece.reasoning
            events.append(("response.reasoning_text.delta", {**self._part(), "delta": piece.reasoning}))
        if self.chat.mode in ("required", "named"):
            self._forced += piece.content
            if finished:
                for call in forced_calls(self._forced, self.chat.tool_choice, c.finish_reason == "stop"):
                    self._call(call, events)
            return events
        if piece.content and (piece.content.strip() or (self._open is not None and self._open["type"] == "message")):
            self._text(piece.content, lps, events)
        elif lps and self._open is not None and self._open["type"] == "message":
            self.items[-1]["content"][0]["logprobs"].extend(lps)
        for call in piece.calls:
            self._call(call, events)
        if finished:
            self._close(events)
        return events

    def conversation_turn(self) -> dict:
        """The answer as a chat message, for the store (previous_response_id)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.calls:
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        return message


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict, status: str) -> dict:
    out = json.loads(json.dumps(item))
    out["status"] = status
    if out["type"] == "message":
        out["content"] = []
    elif out["type"] == "function_call":
        out["arguments"] = ""
    elif out["type"] == "reasoning":
        out["content"] = []
    return out


def _response_body(req: ResponsesRequest, rid: str, created: int, status: str, output: list[dict],
                   usage: dict | None, incomplete: str | None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None, "model": req.model,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "previous_response_id": req.previous_response_id, "store": req.store,
        "background": req.background,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}},
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False, "truncation": "disabled",
        "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
        "top_logprobs": req.top_logprobs, "metadata": req.metadata or {}, "user": req.user, "output": output,
        "usage": usage,
    }


class Answer:
    """One response in the making: its request, ids, the chat it became, and its writer."""

    def __init__(self, server: OpenAIServer, req: ResponsesRequest, chat: PreparedChat, rid: str,
                 turn: list[dict], history: list[dict], store: ResponseStore) -> None:
        self.server, self.req, self.chat, self.rid = server, req, chat, rid
        self.turn, self.history, self.store = turn, history, store
        self.created = now()
        eager = server.reasoning is None and chat.mode == "none"
        self.writer = ItemWriter(server, chat, eager)
        self.num_output = 0
        self.finish: str | None = None
        self.num_cached = 0

    def feed(self, out: RequestOutput) -> list:
        c = out.outputs[0]
        self.num_output += len(c.token_ids)
        self.finish = c.finish_reason or self.finish
        self.num_cached = out.num_cached_tokens
        lps = _logprob_entries(self.server, c.logprobs) if self.req.wants_logprobs else []
        return self.writer.feed(c, lps)

    def body(self, status: str | None = None) -> dict:
        incomplete = "max_output_tokens" if self.finish == "length" else None
        num_input = len(self.chat.ids)
        usage = {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": self.num_output,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_input + self.num_output}
        if self.server.limits.enable_prompt_tokens_details:
            usage["input_tokens_details"]["cached_tokens"] = self.num_cached
        status = status or ("incomplete" if incomplete else "completed")
        return _response_body(self.req, self.rid, self.created, status, self.writer.items, usage, incomplete)

    def finished_body(self) -> dict:
        """The completed (or incomplete) body; stored if asked."""
        body = self.body()
        if self.req.store:
            self.store.put(body, self.history + self.turn + [self.writer.conversation_turn()])
        return body


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(server.limits.max_stored_responses, server.limits.max_stored_response_bytes)
    background: dict[str, tuple[asyncio.Task, list[str]]] = {}  # response id -> its task and engine request ids

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id {response_id!r} not found (responses are kept in memory: the "
                                f"last {store.capacity} at most)", "NotFoundError", "response_id")
        return found[0]

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"Response with id {response_id!r} not found (responses are kept in memory: the "
                                f"last {store.capacity} at most)", "NotFoundError", "response_id")
        running = background.get(response_id)
        if running is None:
            if found[0].get("background") and found[0]["status"] == "cancelled":
                return found[0]
            raise APIError(400, ("Cannot cancel a synchronous response." if not found[0].get("background") else
                                 f"Only a background response in progress can be cancelled; this one is "
                                 f"{found[0]['status']}."), "BadRequestError", "response_id")
        task, request_ids = running
        server.engine.abort(request_ids)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return store.get(response_id)[0]

    @router.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request) -> Any:
        server.check_request(req)
        req = req.model_copy(update={"model": req.model or server.model_name})
        history: list[dict] = []
        if req.previous_response_id is not None:
            found = store.get(req.previous_response_id)
            if found is None:
                raise APIError(400, f"previous_response_id: no stored response with id {req.previous_response_id!r} "
                                    f"(responses are kept in memory: the last {store.capacity}, "
                                    f"{store.max_bytes >> 20} MiB at most)", "BadRequestError",
                               "previous_response_id")
            history = list(found[1])
        messages, turn = as_chat_messages(req, history)
        chat = await prepare_chat(server, as_chat_request(req, messages))
        answer = Answer(server, req, chat, new_id("resp"), turn, history, store)
        if req.background:
            return await _start_background(server, answer, store, background)
        async with server.grammar_held(chat.params.structured_outputs, "text.format", request):
            async with submitted(server, request, [chat.ids], chat.params, chat.req.priority, chat.req.cache_salt,
                                 chat.lora, "resp", one_id=True) as sub:
                answer.rid = sub.rid
                if req.stream:
                    numbered = [0]  # events sent: an error event mid-stream takes the next number
                    body = guarded_stream(server, sub, _events(sub.collector, answer, numbered),
                                          lambda exc: _error_event(exc, numbered[0]))
                    return StreamingResponse(body, media_type="text/event-stream")
                items = await collect_all(server, sub)
            answer.writer.open_eagerly()
            answer.feed(items[0])
            return answer.finished_body()

    return router


async def _start_background(server: OpenAIServer, answer: Answer, store: ResponseStore,
                            background: dict[str, tuple[asyncio.Task, list[str]]]) -> dict:
    """Queue the response and answer at once (status "queued"); a task runs it, storing it as it
    goes (in_progress, then completed, incomplete, failed or cancelled). It does not end when the
    client's connection does."""
    chat, rid = answer.chat, answer.rid
    request_ids = [rid]
    if chat.params.structured_outputs is not None:  # compiled and held for the request's life
        raise APIError(400, "background: not combined with text.format or forced tool calls here",
                       "BadRequestError", "background")
    try:
        collector = await server.engine.add(request_ids, [chat.ids], chat.params, chat.req.priority,
                                            chat.req.cache_salt, chat.lora)
    except (ValueError, EngineOverloadedError, EngineStopped, EngineDeadError) as exc:
        raise engine_error(exc, server.limits) from exc
    queued = answer.body("queued")
    store.put(queued, answer.history + answer.turn)

    async def run() -> None:
        try:
            store.put(answer.body("in_progress"), answer.history + answer.turn)
            items = await collect(collector)
            answer.writer.open_eagerly()
            if 0 in items:
                answer.feed(items[0])
            answer.finished_body()
        except asyncio.CancelledError:
            store.put(answer.body("cancelled"), answer.history + answer.turn)
        except Exception as exc:  # the engine died or stopped: the response says so
            failed = answer.body("failed")
            failed["error"] = {"code": "server_error", "message": str(exc)}
            store.put(failed, answer.history + answer.turn)
        finally:
            background.pop(rid, None)
            if collector.num_open:
                server.engine.abort(request_ids)

    background[rid] = (asyncio.create_task(run()), request_ids)
    return queued


def _event(kind: str, seq: int, **fields: Any) -> str:
    """One of the Responses API's streamed events: an SSE `event:` line with its JSON."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


def _error_event(exc: Exception, seq: int) -> list[str]:
    return [_event("error", seq, **error_body(*stream_error(exc))["error"])]


async def _events(collector, answer: Answer, numbered: list[int]) -> AsyncIterator[str]:
    """The Responses API's streamed events, in order, numbered (`numbered[0]`: how many so far)."""

    def event(kind: str, **fields: Any) -> str:
        numbered[0] += 1
        return _event(kind, numbered[0] - 1, **fields)

    pending = answer.body("in_progress")
    pending["usage"] = None
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for kind, fields in answer.writer.open_eagerly():
        yield event(kind, **fields)
    while batch := await collector.next_batch():
        for _, out in batch:
            for kind, fields in answer.feed(out):
                yield event(kind, **fields)
    body = answer.finished_body()
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
