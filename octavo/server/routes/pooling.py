"""POST /v1/embeddings (OpenAI's), /v1/rerank (Jina's and Cohere's bodies, also /rerank and
/v2/rerank) and /score (/v1/score; vLLM's): embeddings of any loaded model's final hidden states,
pooled as the server is configured (--pooling-type), computed in the engine's own batches beside
generation. Rerank and score rank by the cosine of the query's and each document's embeddings
(a bi-encoder's score, as vLLM computes it for embedding models)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from octavo.sampling.params import PoolingParams, RequestOutputKind, SamplingParams
from octavo.server.core import APIError, OpenAIServer
from octavo.server.generation import collect_all, submitted
from octavo.server.protocol import INT32_MAX, MAX_PROMPTS_PER_REQUEST, MAX_USER_CHARS, _Body, new_id, now

MAX_DOCUMENTS = 1024  # rerank / score inputs per request (each is one engine request)


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # vLLM's extensions
    normalize: bool | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)

    def inputs(self) -> list[str | list[int]]:
        raw = self.input
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            return [raw]  # type: ignore[list-item]
        return list(raw)  # type: ignore[arg-type]


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_DOCUMENTS)
    top_n: int | None = Field(None, ge=0, le=MAX_DOCUMENTS)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)


def encode_base64(values: list[float]) -> str:
    """OpenAI's base64 embedding: the float32 little-endian bytes, base64 encoded."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()
    hidden_size = server.engine.config.model_config.hidden_size

    def pooling_params(dimensions: int | None, normalize: bool | None) -> PoolingParams:
        if dimensions is not None and dimensions != hidden_size and not server.limits.matryoshka:
            raise APIError(400, f"dimensions: this model's embeddings have {hidden_size} dimensions; shorter ones "
                                "(Matryoshka) need a server started with --matryoshka (for a model trained for them)",
                           "BadRequestError", "dimensions")
        if dimensions is not None and dimensions > hidden_size:
            raise APIError(400, f"dimensions: at most {hidden_size}", "BadRequestError", "dimensions")
        return PoolingParams(server.limits.pooling_type, True if normalize is None else normalize, dimensions)

    async def embed(request: Request, model: str | None, inputs: list[str | list[int]], pooling: PoolingParams,
                    priority: int, truncate: int | None, add_special_tokens: bool = True) -> tuple[list[list[float]], int]:
        """The inputs' embeddings (in order) and their number of prompt tokens."""
        server.check_runner("pooling")
        lora = server.check_model(model)
        if priority != 0 and not server.priority_enabled:
            raise APIError(400, "priority needs a server started with --scheduling-policy priority (or cache-aware)",
                           "BadRequestError", "priority")
        prompts = await server.encode(inputs, add_special_tokens)
        prompts = [server.truncate_prompt(p, truncate) for p in prompts]
        for p in prompts:
            if not p:
                raise APIError(400, "input: an empty input has no embedding", "BadRequestError", "input")
            server.check_prompt_len(p)
        params = SamplingParams(max_tokens=1, pooling=pooling, output_kind=RequestOutputKind.FINAL_ONLY)
        async with submitted(server, request, prompts, params, priority, None, lora, "embd") as sub:
            items = await collect_all(server, sub)
        return [items[i].embedding or [] for i in range(len(prompts))], sum(map(len, prompts))

    @router.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, request: Request) -> dict:
        inputs = req.inputs()
        if not 1 <= len(inputs) <= MAX_PROMPTS_PER_REQUEST * 32:
            raise APIError(400, f"input: 1 to {MAX_PROMPTS_PER_REQUEST * 32} inputs per request", "BadRequestError", "input")
        vectors, num_tokens = await embed(request, req.model, inputs, pooling_params(req.dimensions, req.normalize),
                                          req.priority, req.truncate_prompt_tokens, req.add_special_tokens)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_base64(v) if req.encoding_format == "base64" else v} for i, v in enumerate(vectors)]
        return {"id": new_id("embd"), "object": "list", "created": now(), "model": req.model or server.model_name,
                "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def rerank(req: RerankRequest, request: Request) -> dict:
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        vectors, num_tokens = await embed(request, req.model, [req.query, *docs], pooling_params(None, True),
                                          req.priority, req.truncate_prompt_tokens)
        scored = sorted(((cosine(vectors[0], v), i) for i, v in enumerate(vectors[1:])), key=lambda s: (-s[0], s[1]))
        top = scored if req.top_n is None else scored[: req.top_n]
        results = [{"index": i, "relevance_score": score, **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for score, i in top]
        return {"id": new_id("rerank"), "model": req.model or server.model_name, "usage": {"total_tokens": num_tokens},
                "results": results}

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])

    async def score(req: ScoreRequest, request: Request) -> dict:
        left = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
        right = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
        if not left or not right or (len(left) != 1 and len(left) != len(right)):
            raise APIError(400, "text_1 must be one text, or as many texts as text_2 (pairs)", "BadRequestError", "text_1")
        if len(left) + len(right) > MAX_DOCUMENTS:
            raise APIError(400, f"at most {MAX_DOCUMENTS} texts per request", "BadRequestError", "text_2")
        vectors, num_tokens = await embed(request, req.model, [*left, *right], pooling_params(None, True),
                                          req.priority, req.truncate_prompt_tokens)
        lvec, rvec = vectors[: len(left)], vectors[len(left):]
        pairs = [(lvec[0 if len(left) == 1 else i], r) for i, r in enumerate(rvec)]
        return {"id": new_id("score"), "object": "list", "created": now(), "model": req.model or server.model_name,
                "data": [{"index": i, "object": "score", "score": cosine(a, b)} for i, (a, b) in enumerate(pairs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"])
    return router
