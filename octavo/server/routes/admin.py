"""Operations routes: /health, /version, /metrics, /v1/models, and (with
--allow-runtime-lora-updating) loading and unloading LoRA adapters."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import octavo
from octavo.lora.request import LoRARequest
from octavo.server.core import APIError, OpenAIServer
from octavo.server.guard import error_json
from octavo.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, now


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Any:
        if not server.engine.is_healthy:
            return error_json(503, "engine is not running", "ServiceUnavailableError")
        return PlainTextResponse("")

    @router.get("/version")
    async def version() -> dict:
        return {"version": octavo.__version__}

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(server.engine.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    def model_cards() -> list[dict]:
        base = {"id": server.model_name, "object": "model", "created": now(), "owned_by": "octavo",
                "root": server.model_name, "parent": None, "max_model_len": server.max_model_len}
        aliases = [{**base, "id": name} for name in sorted(server.aliases)]
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": server.model_name}
                    for name, lora in server.loras.items()]
        return [base, *aliases, *adapters]

    @router.get("/v1/models")
    async def models() -> dict:
        cards = model_cards()
        return {"object": "list", "data": [cards[0], *cards[1 + len(server.aliases):]]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """OpenAI's models.retrieve: the card of a served name (the model, an alias, an adapter)."""
        card = next((c for c in model_cards() if c["id"] == model_id), None)
        if card is None:
            served = ", ".join(f"`{c['id']}`" for c in model_cards())
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves {served}.",
                           "NotFoundError", "model")
        return card

    if server.limits.allow_runtime_lora_updating:
        # One load or unload at a time (two at once would take the same name or id); ids count up
        # and are never given again, so a client never sees one id name two adapters.
        updating = asyncio.Lock()
        next_id = itertools.count(max((r.lora_int_id for r in server.loras.values()), default=0) + 1)

        @router.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
            async with updating:
                if body.lora_name in server.loras or body.lora_name == server.model_name:
                    raise APIError(400, f"a model named `{body.lora_name}` is already served", "BadRequestError", "lora_name")
                lora = LoRARequest(body.lora_name, next(next_id), body.lora_path)
                try:
                    await server.engine.add_lora(lora)
                except ValueError as exc:
                    raise APIError(400, str(exc), "BadRequestError", "lora_path") from exc
                server.loras[lora.lora_name] = lora
            return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")

        @router.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            async with updating:
                lora = server.loras.get(body.lora_name)
                if lora is None:
                    raise APIError(404, f"no LoRA adapter named `{body.lora_name}` is loaded", "NotFoundError", "lora_name")
                try:
                    await server.engine.remove_lora(lora.lora_int_id)
                except ValueError as exc:
                    raise APIError(400, str(exc), "BadRequestError", "lora_name") from exc
                del server.loras[body.lora_name]
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
