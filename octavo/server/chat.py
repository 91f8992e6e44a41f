"""A chat request from its body to the engine and back, shared by the routes that speak chat
(/v1/chat/completions, Anthropic's /v1/messages): checks, the conversation through the chat
template, sampling params with the grammar that forces a tool call (`prepare_chat`), and the
assistant messages written from the outputs: logprobs, reasoning (split off by
--reasoning-parser) and tool calls (forced, or read from the model's own by --tool-call-parser),
whole or streamed (`ChatChoices`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


from octavo.lora.request import LoRARequest
from octavo.request import CompletionOutput, RequestOutput, TokenLogprob
from octavo.sampling.params import SamplingParams
from octavo.server.core import APIError, OpenAIServer, sampling_params, vllm_prompt_logprobs
from octavo.server.protocol import ChatCompletionRequest
from octavo.server.parsers.tool_calls import CallFormat, ParsedCall, Schemas, tool_schemas
from octavo.server.parsers.turn import TurnStream
from octavo.server.tools import forced_call_constraint, parse_forced_calls


def forced_calls(text: str, tool_choice: Any, complete: bool) -> list[ParsedCall]:
    """The calls of a forced answer (`text`: the answer after any reasoning). Cut by max_tokens
    (`complete` False): the calls written, the last one as far as it went (finish_reason "length"
    says so). Ended otherwise with no call (the model stopped inside a reasoning it never closed,
    so the grammar never began; or a stop string cut the call): an APIError saying so, never an
    empty answer."""
    calls = parse_forced_calls(text, tool_choice, complete)
    if calls or not complete:
        return calls or []
    named = tool_choice != "required"
    raise APIError(500, f"the model ended its answer without the tool call that tool_choice "
                        f"{'names' if named else 'requires'}: a constraint that waits for the reasoning's end never "
                        "began when the model wrote no closing tag, and a stop string can cut a call; raise "
                        "max_tokens, turn its thinking off (chat_template_kwargs enable_thinking false), or drop "
                        "stop strings", "ModelOutputError", "tool_choice")


def chat_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None, as_ids: bool = False) -> dict | None:
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = server.logprob_token(token_id, as_ids)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}


class ChatChoices:
    """Assistant messages. `mode`: "none" (text), "auto" (the model's own calls read by `calls`,
    its tool-call format), "required" (a JSON array of calls, grammar-enforced) or "named" (one
    function's arguments, grammar-enforced). With a reasoning parser, the reasoning is split off
    first (`reasoning_content`) and calls are read from the answer after it."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, server: OpenAIServer, mode: str, tool_choice: Any, parallel: bool = True,
                 calls: CallFormat | None = None, schemas: Schemas | None = None, starts_in_reasoning: bool = False,
                 include_reasoning: bool = True, as_ids: bool = False, return_token_ids: bool = False,
                 echo: str = "") -> None:
        self.server, self.mode, self.tool_choice, self.parallel = server, mode, tool_choice, parallel
        self.as_ids, self.return_token_ids = as_ids, return_token_ids
        self.echo = echo  # vLLM's chat echo: the last (assistant) message's text starts the answer
        self._echoed: set[int] = set()
        self.calls, self.schemas = (calls if mode == "auto" else None), schemas
        self.reasoning, self.starts_in_reasoning = server.reasoning, starts_in_reasoning
        self.include_reasoning = include_reasoning
        self._buffers: dict[int, str] = {}  # "required" / "named": the answer's text so far per choice
        self._named_started: set[int] = set()
        self._turns: dict[int, TurnStream] = {}

    def _turn(self) -> TurnStream:
        return TurnStream(self.reasoning, self.starts_in_reasoning, self.calls, self.schemas,
                          None if self.parallel else 1)

    def _reasoning_fields(self, reasoning: str | None) -> dict[str, Any]:
        # vLLM's reasoning_content, and `reasoning`, the name newer clients read (null when none)
        if self.reasoning is None or not self.include_reasoning or reasoning is None:
            return {"reasoning": None, "reasoning_content": None}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def _finish(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason == "stop" and self.mode != "named":  # OpenAI: a named call ends with "stop"
            return "tool_calls"
        return reason

    def final(self, index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        turn = self._turn()
        piece = turn.feed(c.text, finished=True)
        reasoning = piece.reasoning if turn.has_reasoning else None
        content: str | None = piece.content
        calls = turn.calls
        if self.mode in ("required", "named") and c.finish_reason in ("stop", "length"):
            # the constrained JSON is never the content; a call cut by max_tokens comes back as far as it
            # went (finish_reason "length"), and one that never began is an error (forced_calls)
            calls = forced_calls(piece.content, self.tool_choice, complete=c.finish_reason == "stop")
            content = None
        elif calls:
            content = content.strip() or None
        if self.echo and not calls:
            content = self.echo + (content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content, **self._reasoning_fields(reasoning)}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        choice = {"index": index, "message": message, "logprobs": chat_logprobs(self.server, c.logprobs, self.as_ids),
                  "finish_reason": self._finish(c.finish_reason, bool(calls)), "stop_reason": c.stop_reason}
        choice["token_ids"] = list(c.token_ids) if self.return_token_ids else None
        return choice

    def delta(self, index: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        logprobs = chat_logprobs(self.server, c.logprobs, self.as_ids)
        done = c.finish_reason is not None
        has_calls = False
        if self.mode in ("named", "required"):  # the forced call is the answer after any reasoning
            piece = self._turns.setdefault(index, self._turn()).feed(c.text, finished=done)
            text = piece.content
        if self.mode == "named":
            self._buffers[index] = self._buffers.get(index, "") + text
            if done:  # a call that never began is an error event, not an empty call (forced_calls)
                forced_calls(self._buffers.pop(index), self.tool_choice, complete=c.finish_reason == "stop")
            delta: dict[str, Any] = self._reasoning_fields(piece.reasoning) if piece.reasoning else {}
            if index not in self._named_started and (text or done):
                self._named_started.add(index)
                call = ParsedCall(self.tool_choice.function.name, "")
                delta["tool_calls"] = [call.as_openai(0) | {"function": {"name": call.name, "arguments": text}}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            has_calls = True
        elif self.mode == "required":
            self._buffers[index] = self._buffers.get(index, "") + text
            delta = self._reasoning_fields(piece.reasoning) if piece.reasoning else {}
            if done:
                calls = forced_calls(self._buffers.pop(index), self.tool_choice, complete=c.finish_reason == "stop")
                has_calls = bool(calls)
                if calls:
                    delta["tool_calls"] = [call.as_openai(k) for k, call in enumerate(calls)]
        else:
            turn = self._turns.setdefault(index, self._turn())
            first_call = len(turn.calls)
            piece = turn.feed(c.text, finished=done)
            delta = self._reasoning_fields(piece.reasoning) if piece.reasoning else {}
            if self.echo and index not in self._echoed:
                self._echoed.add(index)
                delta["content"] = self.echo
            if piece.content:
                delta["content"] = delta.get("content", "") + piece.content
            if piece.calls:
                delta["tool_calls"] = [call.as_openai(first_call + k) for k, call in enumerate(piece.calls)]
            has_calls = bool(turn.calls)
        if not delta and not done and not c.logprobs and not (self.return_token_ids and c.token_ids):
            return []  # (a chunk still carries token ids asked for, text or not)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": self._finish(c.finish_reason, has_calls)}
        choice["token_ids"] = list(c.token_ids) if self.return_token_ids else None
        return [choice]

    def first_chunks(self, num_choices: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(num_choices)]

    def stream_start_fields(self, prompts: list[list[int]]) -> dict:
        return {"prompt_token_ids": prompts[0]} if self.return_token_ids else {}

    def extra_fields(self, finals: dict[int, RequestOutput]) -> dict:
        """vLLM's top-level prompt_logprobs (null unless asked) and prompt_token_ids (if asked)."""
        out = finals.get(0)
        fields: dict[str, Any] = {"prompt_logprobs": None}
        if out is not None and out.prompt_logprobs is not None:
            fields["prompt_logprobs"] = vllm_prompt_logprobs(self.server, out.prompt_logprobs)
        fields["prompt_token_ids"] = list(out.prompt_token_ids) if self.return_token_ids and out is not None else None
        return fields


@dataclass(slots=True)
class PreparedChat:
    """A chat request checked, rendered and turned into sampling params, ready for the engine."""

    req: ChatCompletionRequest  # with max_tokens resolved
    ids: list[int]
    params: SamplingParams
    mode: str  # "none", "auto", "required" or "named" (see ChatChoices)
    tool_choice: Any
    calls: CallFormat | None  # how "auto" reads the model's calls
    schemas: Schemas
    starts_in_reasoning: bool
    constraint_param: str  # the field a 400 about the output constraint names
    lora: LoRARequest | None
    echo: str = ""  # vLLM's echo: the text the answer starts with (the last message's, when the assistant's)

    def choices(self, server: OpenAIServer) -> ChatChoices:
        return ChatChoices(server, self.mode, self.tool_choice, self.req.parallel_tool_calls, self.calls, self.schemas,
                           self.starts_in_reasoning, self.req.include_reasoning, server.tokens_as_ids(self.req),
                           self.req.return_token_ids, self.echo)


async def prepare_chat(server: OpenAIServer, req: ChatCompletionRequest) -> PreparedChat:
    """Check a chat request, render its conversation and build its sampling params (with the
    grammar that forces a call, if one is asked); APIError (400/404) for what cannot be served."""
    lora = server.check_request(req)
    if req.chat_template is not None and not server.limits.trust_request_chat_template:
        raise APIError(400, "chat_template: a request's own chat template needs a server started with "
                            "--trust-request-chat-template", "BadRequestError", "chat_template")
    try:
        template_kwargs = req.template_kwargs()
    except ValueError as exc:
        raise APIError(400, str(exc), "BadRequestError", "chat_template_kwargs") from exc
    tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    calls = server.auto_tool_format()
    if tool_choice == "auto" and req.tools and calls is None:
        raise APIError(400, 'tool_choice "auto" needs a server started with --tool-call-parser (this model\'s chat '
                            'template writes the tools in its own format); use "required" or a named function to '
                            'force a call', "BadRequestError", "tool_choice")
    try:
        forced = forced_call_constraint(req.tools or [], tool_choice, req.parallel_tool_calls)
    except ValueError as exc:  # the tools' schemas together are larger than a constraint may be
        raise APIError(400, f"tools: the schema that forces the call (every tool's parameters) cannot be used: {exc}",
                       "BadRequestError", "tools") from exc
    if forced is not None and req.structured_fields_set():
        raise APIError(400, f"{req.structured_param()}: an output constraint cannot be combined with a forced tool call",
                       "BadRequestError", req.structured_param())
    tools = req.tools if tool_choice != "none" else None
    ids = await server.render_chat(req.plain_messages(), req.add_generation_prompt, tools, template_kwargs)
    ids = server.truncate_prompt(ids, req.truncate_prompt_tokens, req.truncation_side)
    server.check_prompt_len(ids)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    req = req.model_copy(update={"max_tokens": max_tokens})
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    req = server.with_generation_defaults(req)
    params = sampling_params(req, server.default_max_tokens(len(ids)), logprobs)
    if forced is not None:
        params = dataclasses.replace(params, structured_outputs=forced)
    mode = "named" if not isinstance(tool_choice, str) else (
        tool_choice if tool_choice in ("required", "none") else ("auto" if req.tools else "none"))
    if mode == "auto" and calls is not None and calls.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)  # its markers are special tokens
    starts_in_reasoning = server.prompt_opens_reasoning(ids)
    if params.structured_outputs is not None and _thinks(server, req, template_kwargs, starts_in_reasoning, ids):
        # a reasoning model that thinks first: the constraint (or forced call) applies to its
        # answer, after the thinking
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
            params.structured_outputs, after_text=server.reasoning.end))
    last = req.messages[-1]
    echo = last.text() if req.echo and (last.role == "assistant" or not req.add_generation_prompt) else ""
    return PreparedChat(req, ids, params, mode, tool_choice, calls, tool_schemas(req.tools),
                        starts_in_reasoning, "tools" if forced else req.structured_param(), lora, echo)


def _thinks(server: OpenAIServer, req: ChatCompletionRequest, template_kwargs: dict[str, Any],
            starts_in_reasoning: bool, ids: list[int]) -> bool:
    """Whether a constrained request's answer comes after reasoning: its prompt opened the
    reasoning, or it asked for thinking (enable_thinking / thinking true, a reasoning_effort). Not
    otherwise: a constraint held back for a closing tag a model may never write would not be a
    constraint (a model that does not reason, a template without the switch), so it applies from
    the first token then, and a model that would have thought answers at once."""
    if server.reasoning is None or server.reasoning_ended(ids):
        return False
    asked = (template_kwargs.get("enable_thinking") is True or template_kwargs.get("thinking") is True
             or req.reasoning_effort not in (None, "none"))
    return starts_in_reasoning or asked


