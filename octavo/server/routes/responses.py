"""POST /v1/responses (OpenAI's Responses API) and GET /v1/responses/{id}: text or message input,
instructions, max_output_tokens, text.format through structured outputs, streamed events in the
official shape, and previous_response_id from a bounded in-memory store. Not covered (400):
tools, reasoning, include, background, conversation objects; see docs/API.md."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator

from octavo.sampling.params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from octavo.server.core import APIError, OpenAIServer, param_of
from octavo.server.generation import collect_all, guarded_stream, submitted
from octavo.server.guard import error_body
from octavo.server.protocol import INT32_MAX, MAX_MESSAGES, MAX_USER_CHARS, _Body, new_id, now

# OpenAI's limits on metadata: 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class InputContent(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputContent]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(c.text for c in self.content)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_body: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat = TextFormat()


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
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
        if self.tools:
            return "tools", "tools: tool calling on /v1/responses is not supported by this server (use /v1/chat/completions)"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice: needs tools, which /v1/responses does not support here"
        if self.truncation == "auto":
            return "truncation", "truncation: only 'disabled' is supported (a too-long input is refused)"
        for name in ("reasoning", "include", "background", "conversation", "prompt", "top_logprobs", "service_tier"):
            value = (self.model_extra or {}).get(name)
            if value not in (None, False, [], {}, "auto", "default"):
                return name, f"{name}: not supported on /v1/responses by this server"
        return self.refused_extra()

    def constraint(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.schema_body is None:
            raise ValueError("text.format: type json_schema needs a schema")
        return StructuredOutputsParams(json=fmt.schema_body)


class ResponseStore:
    """The last stored responses (their body and the conversation they end), at most `capacity` of
    them and `max_bytes` of their JSON together: oldest dropped first. A conversation is counted
    whole in each response that ends it (shared turns counted again: an overestimate, never an
    under-). A response larger than `max_bytes` alone is not stored."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> bool:
        """Store it (True), dropping the oldest to make room; False if it alone is too large."""
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        self._items[body["id"]] = (body, conversation, size)
        self.num_bytes += size
        while len(self._items) > self.capacity or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._items.popitem(last=False)[1][2]
        return True

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        found = self._items.get(response_id)
        return None if found is None else (found[0], found[1])

    def __len__(self) -> int:
        return len(self._items)


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _response_body(req: ResponsesRequest, rid: str, created: int, status: str, output: list[dict],
                   usage: dict | None, incomplete: str | None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None, "model": req.model,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "previous_response_id": req.previous_response_id, "store": req.store,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}},
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "truncation": "disabled",
        "metadata": req.metadata or {}, "user": req.user, "output": output, "usage": usage,
    }


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    store = ResponseStore(server.limits.max_stored_responses, server.limits.max_stored_response_bytes)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response with id {response_id!r}", "NotFoundError", "response_id")
        return found[0]

    @router.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request) -> Any:
        lora = server.check_request(req)
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
        turn = ([{"role": "user", "content": req.input}] if isinstance(req.input, str)
                else [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.input])
        conversation = history + turn
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        ids = await server.render_chat(system + conversation, True)
        server.check_prompt_len(ids)
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
                max_tokens=req.max_output_tokens or server.max_model_len - len(ids), structured_outputs=req.constraint(),
                output_kind=RequestOutputKind.DELTA)
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", param_of(str(exc)) or "text") from exc
        async with server.grammar_held(params.structured_outputs, "text.format", request):
            async with submitted(server, request, [ids], params, req.priority, req.cache_salt, lora, "resp",
                                 one_id=True) as sub:
                context = (req, sub.rid, new_id("msg"), ids, conversation, store)
                if req.stream:
                    numbered = [0]  # events sent: an error event mid-stream takes the next number
                    body = guarded_stream(server, sub, _events(sub.collector, context, numbered),
                                          lambda exc: _error_event(exc, numbered[0]))
                    return StreamingResponse(body, media_type="text/event-stream")
                items = await collect_all(server, sub)
            c = items[0].outputs[0]
            return _finish(context, now(), c.text, len(c.token_ids), c.finish_reason)

    return router


def _finish(context: tuple, created: int, text: str, num_output: int, finish_reason: str | None) -> dict:
    """The completed (or incomplete: cut by max_output_tokens) response body; stored if asked."""
    req, rid, item_id, ids, conversation, store = context
    incomplete = "max_output_tokens" if finish_reason == "length" else None
    usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": 0}, "output_tokens": num_output,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": len(ids) + num_output}
    body = _response_body(req, rid, created, "incomplete" if incomplete else "completed",
                          [_message_item(item_id, text, "completed")], usage, incomplete)
    if req.store:
        store.put(body, conversation + [{"role": "assistant", "content": text}])
    return body


def _event(kind: str, seq: int, **fields: Any) -> str:
    """One of the Responses API's streamed events: an SSE `event:` line with its JSON."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


def _error_event(exc: Exception, seq: int) -> list[str]:
    return [_event("error", seq, **error_body(503, str(exc), "ServiceUnavailableError")["error"])]


async def _events(collector, context: tuple, numbered: list[int]) -> AsyncIterator[str]:
    """The Responses API's streamed events, in order, numbered (`numbered[0]`: how many so far)."""
    req, rid, item_id = context[0], context[1], context[2]
    created = now()

    def event(kind: str, **fields: Any) -> str:
        numbered[0] += 1
        return _event(kind, numbered[0] - 1, **fields)

    part = {"item_id": item_id, "output_index": 0, "content_index": 0}
    pending = _response_body(req, rid, created, "in_progress", [], None, None)
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    yield event("response.output_item.added", output_index=0, item=_message_item(item_id, "", "in_progress"))
    yield event("response.content_part.added", **part, part={"type": "output_text", "text": "", "annotations": []})
    text, num_output, finish = [], 0, None
    while batch := await collector.next_batch():
        for _, out in batch:
            c = out.outputs[0]
            num_output += len(c.token_ids)
            finish = c.finish_reason or finish
            if c.text:
                text.append(c.text)
                yield event("response.output_text.delta", **part, delta=c.text, logprobs=[])
    full = "".join(text)
    yield event("response.output_text.done", **part, text=full, logprobs=[])
    yield event("response.content_part.done", **part, part={"type": "output_text", "text": full, "annotations": []})
    yield event("response.output_item.done", output_index=0, item=_message_item(item_id, full, "completed"))
    body = _finish(context, created, full, num_output, finish)
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
