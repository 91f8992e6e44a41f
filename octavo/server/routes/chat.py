"""POST /v1/chat/completions: messages through the chat template to assistant messages (with
logprobs, structured outputs, reasoning and tool calls; see octavo/server/chat.py), whole or
streamed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from octavo.server.chat import prepare_chat
from octavo.server.core import OpenAIServer
from octavo.server.generation import run_request
from octavo.server.protocol import ChatCompletionRequest


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        chat = await prepare_chat(server, req)
        async with server.grammar_held(chat.params.structured_outputs, chat.constraint_param, request):
            return await run_request(server, request, chat.req, [chat.ids], chat.params, chat.choices(server),
                                     "chatcmpl", chat.lora)

    return router
