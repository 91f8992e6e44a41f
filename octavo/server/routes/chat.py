"""POST /v1/chat/completions: messages through the chat template to assistant messages, with
logprobs, structured outputs and tool calls (forced by grammar, or parsed from the model's own
Hermes-style calls), whole or streamed."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from octavo.request import CompletionOutput, RequestOutput, TokenLogprob
from octavo.server.core import APIError, OpenAIServer, sampling_params, vllm_prompt_logprobs
from octavo.server.generation import run_request
from octavo.server.protocol import ChatCompletionRequest
from octavo.server.tools import HermesStream, ParsedCall, forced_call_constraint, parse_forced_calls, parse_hermes


def chat_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = server.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}


class ChatChoices:
    """Assistant messages. `mode`: "none" (text), "auto" (the model's own <tool_call> blocks are
    parsed), "required" (a JSON array of calls, grammar-enforced) or "named" (one function's
    arguments, grammar-enforced)."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, server: OpenAIServer, mode: str, tool_choice: Any, parallel: bool = True) -> None:
        self.server, self.mode, self.tool_choice, self.parallel = server, mode, tool_choice, parallel
        self._buffers: dict[int, str] = {}  # "required": text so far per choice
        self._named_started: set[int] = set()
        self._named_id: dict[int, str] = {}
        self._hermes: dict[int, HermesStream] = {}

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ParsedCall]] | None:
        """(content, calls) when the output holds tool calls. An output cut by max_tokens keeps the
        calls written whole before the cut (a client sees them with finish_reason "length")."""
        if finish_reason not in ("stop", "length"):
            return None
        if self.mode in ("required", "named"):
            calls = parse_forced_calls(text, self.tool_choice, complete=finish_reason == "stop")
            return None if calls is None else (None, calls)
        if self.mode == "auto":
            content, calls = parse_hermes(text)
            return (content, calls if self.parallel else calls[:1]) if calls else None
        return None

    def _finish(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason == "stop" and self.mode != "named":  # OpenAI: a named call ends with "stop"
            return "tool_calls"
        return reason

    def final(self, index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        parsed = self._calls(c.text, c.finish_reason)
        if parsed is not None:
            message = {"role": "assistant", "content": parsed[0], "tool_calls": [call.as_openai() for call in parsed[1]]}
        return {"index": index, "message": message, "logprobs": chat_logprobs(self.server, c.logprobs),
                "finish_reason": self._finish(c.finish_reason, parsed is not None), "stop_reason": c.stop_reason}

    def delta(self, index: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        logprobs = chat_logprobs(self.server, c.logprobs)
        done = c.finish_reason is not None
        has_calls = False
        if self.mode == "named":
            delta: dict[str, Any] = {}
            if index not in self._named_started and (c.text or done):
                self._named_started.add(index)
                call = ParsedCall(self.tool_choice.function.name, "")
                self._named_id[index] = call.id
                delta = {"tool_calls": [call.as_openai(0) | {"function": {"name": call.name, "arguments": c.text}}]}
            elif c.text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": c.text}}]}
            has_calls = True
        elif self.mode == "required":
            self._buffers[index] = self._buffers.get(index, "") + c.text
            delta = {}
            if done:
                parsed = self._calls(self._buffers.pop(index), c.finish_reason)
                has_calls = parsed is not None
                delta = {"tool_calls": [call.as_openai(k) for k, call in enumerate(parsed[1])]} if parsed else {}
        elif self.mode == "auto":
            stream = self._hermes.setdefault(index, HermesStream())
            first_call = len(stream.calls)
            content, calls = stream.feed(c.text, finished=done)
            if not self.parallel:  # parallel_tool_calls false: the first call only
                calls = calls[: max(0, 1 - first_call)]
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [call.as_openai(first_call + k) for k, call in enumerate(calls)]
            has_calls = bool(stream.calls)
        else:
            delta = {"content": c.text} if c.text else {}
        if not delta and not done and not c.logprobs:
            return []
        return [{"index": index, "delta": delta, "logprobs": logprobs,
                 "finish_reason": self._finish(c.finish_reason, has_calls)}]

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(num_choices)]

    def extra_fields(self, finals: dict[int, RequestOutput]) -> dict:
        out = finals.get(0)
        if out is not None and out.prompt_logprobs is not None:
            return {"prompt_logprobs": vllm_prompt_logprobs(self.server, out.prompt_logprobs)}
        return {}


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        lora = server.check_request(req)
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if tool_choice == "auto" and req.tools and server.limits.tool_call_parser is None:
            raise APIError(400, 'tool_choice "auto" needs a server started with --tool-call-parser (e.g. hermes); '
                                'use "required" or a named function to force a call', "BadRequestError", "tool_choice")
        try:
            forced = forced_call_constraint(req.tools or [], tool_choice, req.parallel_tool_calls)
        except ValueError as exc:  # the tools' schemas together are larger than a constraint may be
            raise APIError(400, f"tools: the schema that forces the call (every tool's parameters) cannot be used: {exc}",
                           "BadRequestError", "tools") from exc
        if forced is not None and req.structured_fields_set():
            raise APIError(400, f"{req.structured_param()}: an output constraint cannot be combined with a forced tool call",
                           "BadRequestError", req.structured_param())
        tools = req.tools if tool_choice != "none" else None
        ids = await server.render_chat(req.plain_messages(), req.add_generation_prompt, tools)
        server.check_prompt_len(ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        req = req.model_copy(update={"max_tokens": max_tokens})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, server.max_model_len - len(ids), logprobs)
        if forced is not None:
            params = dataclasses.replace(params, structured_outputs=forced)
        mode = "named" if not isinstance(tool_choice, str) else (
            tool_choice if tool_choice in ("required", "none") else ("auto" if req.tools else "none"))
        choices = ChatChoices(server, mode, tool_choice, req.parallel_tool_calls)
        async with server.grammar_held(params.structured_outputs, "tools" if forced else req.structured_param(), request):
            return await run_request(server, request, req, [ids], params, choices, "chatcmpl", lora)

    return router
