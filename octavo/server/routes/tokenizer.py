"""POST /tokenize and /detokenize, GET /tokenizer_info (vLLM's): a prompt or conversation to token
ids and back, and the tokenizer's configuration, so that a client (lm-eval's remote tokenizer)
needs no tokenizer files of its own."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from octavo.server.core import APIError, OpenAIServer
from octavo.server.protocol import RESERVED_TEMPLATE_KEYS, DetokenizeRequest, TokenizeRequest
from octavo.tokenizer import Tokenizer


def tokenizer_info(server: OpenAIServer) -> dict[str, Any]:
    """What tokenizer_config.json would say (vLLM's TokenizerInfoResponse): class, special tokens,
    chat template, added tokens; model_max_length is this server's context length."""
    tok = server.tokenizer
    name = tok.tokenizer_class if isinstance(tok, Tokenizer) else type(tok).__name__
    info: dict[str, Any] = {"tokenizer_class": name, "model_max_length": server.max_model_len,
                            "vocab_size": server.vocab_size, "chat_template": getattr(tok, "chat_template", None)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tok, name, None)
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    info["added_tokens_decoder"] = {str(i): {"content": t.content, "special": t.special} for i, t in added.items()}
    return info


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    info = tokenizer_info(server)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.messages is not None:
            kwargs = dict(body.chat_template_kwargs or {})
            if any(k in RESERVED_TEMPLATE_KEYS or k.startswith("_") for k in kwargs):
                raise APIError(400, "chat_template_kwargs: names the server sets cannot be given", "BadRequestError",
                               "chat_template_kwargs")
            if body.continue_final_message:
                if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
                    raise APIError(400, "continue_final_message needs add_generation_prompt: false", "BadRequestError",
                                   "continue_final_message")
                kwargs["continue_final_message"] = True
            # a conversation's special tokens come from its template; add_special_tokens adds the
            # tokenizer's on top only when asked (vLLM's default for messages is false)
            add_special = body.add_special_tokens and "add_special_tokens" in body.model_fields_set
            ids = await server.render_chat([m.as_template_dict() for m in body.messages],
                                           body.add_generation_prompt and not body.continue_final_message,
                                           template_kwargs=kwargs, add_special_tokens=add_special)
        else:
            ids = (await server.encode([body.prompt or ""], body.add_special_tokens))[0]
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len,
                               "token_strs": None}  # null unless asked, as vLLM answers
        if body.return_token_strs:
            out["token_strs"] = list(server.tokenizer.convert_ids_to_tokens(ids))
        return out

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = server.vocab_size
        if len(body.tokens) > server.max_model_len:  # no sequence here is longer; the text could be ~10x the body
            raise APIError(400, f"'tokens' holds {len(body.tokens)} ids; at most {server.max_model_len} "
                                "(this server's context length) are decoded at once", "BadRequestError", "tokens")
        if not all(0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": await server.off_loop(server.tokenizer.decode, body.tokens)}

    @router.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict:
        return info

    return router
