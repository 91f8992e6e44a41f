"""POST /v1/completions: prompts (text, token ids, or lists of them) to text choices, with echo,
logprobs, prompt_logprobs, structured outputs and vLLM's beam search."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from octavo.request import CompletionOutput, RequestOutput, TokenLogprob
from octavo.server.core import APIError, OpenAIServer, param_of, sampling_params, vllm_prompt_logprobs
from octavo.server.generation import run_request
from octavo.server.protocol import MAX_PROMPTS_PER_REQUEST, CompletionRequest


def completion_logprobs(server: OpenAIServer, lps: list[TokenLogprob] | None, offset: int = 0,
                        as_ids: bool = False) -> dict | None:
    """OpenAI's legacy logprobs object (an echoed first prompt token has logprob and top None)."""
    if lps is None:
        return None
    tokens, offsets, pos = [], [], offset
    for lp in lps:
        text = server.logprob_token(lp.token_id, as_ids)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        # OpenAI's: the top alternatives and always the sampled token (logprobs 0: that token alone)
        "top_logprobs": [{**{server.logprob_token(t, as_ids): v for t, v in lp.top.items()}, text: lp.logprob}
                         if lp.top is not None else None for lp, text in zip(lps, tokens)],
        "text_offset": offsets,
    }


class CompletionChoices:
    """Text choices; with echo, each choice starts with its prompt (and its logprobs, if asked)."""

    object_name = chunk_name = "text_completion"

    def __init__(self, server: OpenAIServer, n: int, echo_texts: list[str] | None, want_logprobs: bool,
                 as_ids: bool = False, return_token_ids: bool = False, prompt_logprobs_asked: bool = False) -> None:
        self.server, self.n, self.echo_texts, self.want_logprobs = server, n, echo_texts, want_logprobs
        # with echo, prompt logprobs are asked for the echoed logprobs; returned apart only if asked
        self.prompt_logprobs_asked = prompt_logprobs_asked
        self.as_ids, self.return_token_ids = as_ids, return_token_ids
        self._offsets: dict[int, int] = {}  # streamed characters per choice, for text_offset
        self._started: set[int] = set()

    def _echo(self, index: int, out: RequestOutput) -> tuple[str, list[TokenLogprob]]:
        if self.echo_texts is None:
            return "", []
        prompt_lps: list[TokenLogprob] = []
        if self.want_logprobs and out.prompt_logprobs is not None:  # nothing predicts the first token
            prompt_lps = [TokenLogprob(out.prompt_token_ids[0], None, None), *out.prompt_logprobs[1:]]  # type: ignore[arg-type]
        return self.echo_texts[index // self.n], prompt_lps

    def final(self, index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        prefix, prompt_lps = self._echo(index, out)
        lps = None if c.logprobs is None else prompt_lps + list(c.logprobs)
        choice = {"index": index, "text": prefix + c.text, "logprobs": completion_logprobs(self.server, lps, 0, self.as_ids),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "prompt_logprobs": None}
        if out.prompt_logprobs is not None and (self.echo_texts is None or self.prompt_logprobs_asked):
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.server, out.prompt_logprobs)
        asked = self.return_token_ids  # vLLM's keys, null unless asked
        choice["prompt_token_ids"] = list(out.prompt_token_ids) if asked else None
        choice["token_ids"] = list(c.token_ids) if asked else None
        return choice

    def delta(self, index: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        prefix, prompt_lps, extra = "", [], {}
        if index not in self._started:
            self._started.add(index)
            prefix, prompt_lps = self._echo(index, out)
            if out.prompt_logprobs is not None and (self.echo_texts is None or self.prompt_logprobs_asked):
                extra["prompt_logprobs"] = vllm_prompt_logprobs(self.server, out.prompt_logprobs)
            if self.return_token_ids:
                extra["prompt_token_ids"] = list(out.prompt_token_ids)
        if self.return_token_ids:
            extra["token_ids"] = list(c.token_ids)
        if not (prefix or c.text) and c.finish_reason is None and not c.logprobs and not (self.return_token_ids and c.token_ids):
            return []
        lps = None if c.logprobs is None else prompt_lps + list(c.logprobs)
        text = prefix + c.text
        choice = {"index": index, "text": text,
                  "logprobs": completion_logprobs(self.server, lps, self._offsets.get(index, 0), self.as_ids),
                  "finish_reason": c.finish_reason, **extra}
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return [choice]

    def first_chunks(self, num_choices: int) -> list[dict]:
        return []

    def stream_start_fields(self, prompts: list[list[int]]) -> dict:
        return {}

    def extra_fields(self, finals: dict[int, RequestOutput]) -> dict:
        return {}


def build_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        lora = server.check_request(req)
        raw = req.prompt_list()
        if not raw:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        if len(raw) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(400, f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(raw)}",
                           "BadRequestError", "prompt")
        prompts = [server.truncate_prompt(ids, req.truncate_prompt_tokens, req.truncation_side) for ids in await server.encode(raw)]
        for ids in prompts:
            server.check_prompt_len(ids)
        if req.use_beam_search:
            if req.echo or req.prompt_logprobs is not None or req.structured_fields_set():
                raise APIError(400, "use_beam_search: echo, prompt_logprobs and structured outputs are not "
                                    "combined with beam search", "BadRequestError", "use_beam_search")
            try:
                params = req.to_beam_search_params(16)
            except ValueError as exc:
                raise APIError(400, str(exc), "BadRequestError", param_of(str(exc))) from exc
            return await run_request(server, request, req, prompts, params, CompletionChoices(server, params.n, None, False),
                                     "cmpl", lora)
        req = server.with_generation_defaults(req)
        params = sampling_params(req, 16, req.logprobs)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        echo_texts = None
        if req.echo:
            echo_texts = [p if isinstance(p, str) else await server.off_loop(server.tokenizer.decode, p) for p in raw]
        choices = CompletionChoices(server, params.n, echo_texts, req.logprobs is not None, server.tokens_as_ids(req),
                                    req.return_token_ids, req.prompt_logprobs is not None)
        async with server.grammar_held(params.structured_outputs, req.structured_param(), request):
            return await run_request(server, request, req, prompts, params, choices, "cmpl", lora)

    return router
