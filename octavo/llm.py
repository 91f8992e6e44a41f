"""LLM: the offline Python API (generate, chat, embed) over an LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from octavo.engine import LLMEngine
from octavo.engine_args import EngineArgs
from octavo.request import RequestOutput
from octavo.lora.request import LoRARequest
from octavo.sampling.params import BeamSearchParams, PoolingParams, RequestOutputKind, SamplingParams
from octavo.tokenizer import apply_chat_template

Prompt = str | list[int]


class LLM:
    """`LLM()` serves the embedded default model; `LLM("path/to/hf-dir", block_size=8, ...)` another.

    Keyword arguments are EngineArgs fields (max_model_len, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, kv_cache_memory, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (tests share one set of weights between engines); the LLM
        owns it from then on (closed with it)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    def __del__(self) -> None:
        # `del llm` (vLLM users' way to let an engine go) releases what it holds beyond memory, as
        # close() does: a new LLM on the same second-tier folder then gets it
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.close()
            except Exception:  # interpreter shutdown, or a half-built engine: nothing more to release
                pass

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer: for a converted GGUF an `octavo.tokenizer.Tokenizer` (encode,
        decode, vocabulary, special tokens and chat template as transformers' tokenizer gives them;
        anything else is answered by transformers' object, `.hf`, made on first use), else
        transformers' own."""
        return self.engine.tokenizer

    def close(self) -> None:
        """Release what the engine holds beyond memory: worker processes, and the second KV
        tier (its cached blocks written for the next start)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes (but the pinned ones). Returns how many blocks were forgotten."""
        return self.engine.reset_prefix_cache()

    def pin_prefix(self, prompt: str | list[int] | dict) -> tuple[int, int]:
        """Keep a prompt's KV cached for good (LLMEngine.pin_prefix): text, token ids, or
        {"messages": [...]}. Returns the (tokens, blocks) pinned."""
        return self.engine.pin_prefix(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `lora_request`: one
        adapter for all prompts or one (or None, the base model) per prompt.

        A prompt is a string, a list of token ids, or vLLM's dicts: {"prompt": text} (TextPrompt) or
        {"prompt_token_ids": ids} (TokensPrompt), either with "cache_salt" and "lora_request", which
        then win over the arguments. If any prompt is refused (too long, invalid token ids) a
        ValueError names it and no prompt is left running.
        """
        batch = _as_prompt_list(prompts)
        params = [
            # only final outputs are returned, so none of the intermediate ones is built
            dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            if p.output_kind is RequestOutputKind.CUMULATIVE else p
            for p in _broadcast(sampling_params or SamplingParams(), len(batch), "sampling_params")
        ]
        priorities = _broadcast(0, len(batch), "priority") if priority is None else list(priority)
        salts = _broadcast(cache_salt, len(batch), "cache_salt") if not isinstance(cache_salt, list) else list(cache_salt)
        if len(priorities) != len(batch) or len(salts) != len(batch):
            raise ValueError("priority and cache_salt must have one entry per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(batch)
        if len(loras) != len(batch):
            raise ValueError("lora_request must be one adapter or one entry per prompt")
        for i, prompt in enumerate(batch):  # a prompt dict's own salt and adapter win
            batch[i], extra = _unpack(prompt, i)
            salts[i] = extra.get("cache_salt", salts[i])
            loras[i] = extra.get("lora_request", loras[i])
        return self._run(self._add_all(batch, params, priorities, salts, loras), use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Each prompt's embedding (`output.embedding`): its final hidden states pooled as
        `pooling_params` says (default: the last token's state, normalised), in the same batches
        as generation; outputs in prompt order (vLLM's `LLM.embed`)."""
        params = SamplingParams(max_tokens=1, pooling=pooling_params or PoolingParams(),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Beam search on every prompt (vLLM's `LLM.beam_search`), inside the engine: the beams of
        all prompts batch together and share KV blocks copy-on-write. Each output's completions are
        the best `params.beam_width` hypotheses, best first, with `cumulative_logprob`; a refused
        prompt raises ValueError as in `generate`."""
        unpacked = [_unpack(p, i) for i, p in enumerate(_as_prompt_list(prompts))]
        batch = [prompt for prompt, _ in unpacked]
        salts = [extra.get("cache_salt") for _, extra in unpacked]
        loras = [extra.get("lora_request") for _, extra in unpacked]
        return self._run(self._add_all(batch, [params] * len(batch), [0] * len(batch), salts, loras), use_tqdm)

    def _add_all(self, batch: list, params: list, priorities: list[int], salts: list[str | None],
                 loras: list[LoRARequest | None] | None = None) -> list[str]:
        """Add every prompt, or none: a refused one aborts those already added and raises."""
        ids: list[str] = []
        loras = loras or [None] * len(batch)
        # distinct grammars compile concurrently first; add_request then finds them cached
        grammars = [p.structured_outputs for p in params if getattr(p, "structured_outputs", None) is not None]
        if grammars:
            self.engine.structured.compile_many(grammars)
        try:
            for i, prompt in enumerate(batch):
                rid = str(next(self._ids))
                try:
                    self.engine.add_request(rid, prompt, params[i], priority=priorities[i], cache_salt=salts[i],
                                            lora_request=loras[i])
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
                ids.append(rid)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return ids

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]


_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "lora_request"}


def _unpack(prompt: Any, index: int) -> tuple[Prompt, dict[str, Any]]:
    """A vLLM prompt dict -> (its text or token ids, its cache_salt / lora_request); others as given."""
    if not isinstance(prompt, dict):
        return prompt, {}
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt {index}: keys {unknown} are not supported; a prompt dict takes 'prompt' or "
                         "'prompt_token_ids', with 'cache_salt' and 'lora_request'")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"prompt {index}: a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
    body = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return body, {k: prompt[k] for k in ("cache_salt", "lora_request") if k in prompt}


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return [p if isinstance(p, (str, dict)) else list(p) for p in prompts]  # type: ignore[union-attr]


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
