"""POST /tokenize and /detokenize (vLLM's): a prompt or conversation to token ids, and back."""

from __future__ import annotations

from fastapi import APIRouter

from octavo.server.core import APIError, OpenAIServer
from octavo.server.protocol import DetokenizeRequest, TokenizeRequest


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.messages is not None:
            ids = await server.render_chat([m.as_template_dict() for m in body.messages], body.add_generation_prompt)
        else:
            ids = (await server.encode([body.prompt or ""]))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = server.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": await server.off_loop(server.tokenizer.decode, body.tokens)}

    return router
