"""LLMEngine: add_request, step, abort_request: one step schedules, runs the model, updates the
requests and hands the changed ones to the output processor."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Any

import torch

from octavo.beam_search import BeamGroup
from octavo.config import EngineConfig
from octavo.models import weight_files
from octavo.models.loader import decode_read_bytes
from octavo.models.registry import for_context
from octavo.distributed.executor import TensorParallelExecutor, TensorParallelGroup
from octavo.engine_args import EngineArgs
from octavo.engine_setup import kv_cache_size, load, open_runner_tier, pin_prefix_files
from octavo.kv_cache.manager import KVCacheManager
from octavo.kv_tier import TierStore
from octavo.lora.request import LoRARequest
from octavo.memory import KVSizing
from octavo.model_runner import ModelRunner, RunnerOptions
from octavo.output_processor import OutputProcessor
from octavo.request import FinishReason, Request, RequestOutput, RequestStatus, check_inputs, child_request_id
from octavo.sampling.params import BeamSearchParams, SamplingParams
from octavo.kv_events import BatchEncoder, KVEventStream, group_specs, make_publisher
from octavo.outputs import EngineStats, LoRAStats, StepLog, StepRecord
from octavo.scheduler import Scheduler
from octavo.spec_decode import SpecDecodeController, make_proposer
from octavo.spec_decode.draft_model import load_draft_model
from octavo.structured.manager import StructuredOutputManager
from octavo.threads import StepThread, ThreadGovernor
from octavo.tokenizer import apply_chat_template, encode_prompt

logger = logging.getLogger("octavo")


def rope_for_context(config: EngineConfig, model: torch.nn.Module, tensor_parallel: bool) -> EngineConfig:
    """LongRoPE picks its factor set by the context served (registry.for_context): a max_model_len
    within the original context takes the short set, and the model's tables are rebuilt with it."""
    rope = for_context(config.model_config.rope, config.scheduler.max_model_len)
    rotary = getattr(model, "rotary", None)
    if rotary is None or rotary.rope == rope:  # (the model's tables, which an earlier engine may have set)
        return dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, rope=rope))
    if tensor_parallel:
        raise ValueError("LongRoPE's short factors (a --max-model-len within the original context) under tensor "
                         "parallelism are not supported; serve the full context or one rank")
    rotary.rope = rope
    rotary.reset_tables(next(model.parameters()).device)
    logger.info("LongRoPE: the %s factors (max_model_len %d, original context %d)", "long" if rope.long else "short",
                config.scheduler.max_model_len, rope.original_max_position)
    return dataclasses.replace(config, model_config=dataclasses.replace(config.model_config, rope=rope))


class LLMEngine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, tokenizer: Any, weight_bytes: int,
                 tensor_parallel: TensorParallelGroup | None = None) -> None:
        """`model` is this process's (for tensor parallelism, rank 0's shard, with `config` holding
        one rank's share of the heads); `tensor_parallel` the group of the other ranks, whose
        runners make every call this one makes (octavo.distributed.executor)."""
        config = rope_for_context(config, model, tensor_parallel is not None)
        self.tokenizer = tokenizer
        self._answered = False  # (a request has finished: weight_files.release_writes)
        eos = config.model_config.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        options = RunnerOptions(
            block_size=config.cache.block_size, eos_token_ids=self.eos_token_ids, device=config.device,
            kv_dtype=config.cache.cache_dtype, dtype=config.dtype, attention_backend=config.attention_backend, enforce_eager=config.enforce_eager,
            max_num_seqs=config.scheduler.max_num_seqs, max_model_len=config.scheduler.max_model_len,
            max_loras=config.scheduler.max_loras, max_lora_rank=config.max_lora_rank,
        )
        self.runner = options.build(model, config.model_config)
        self.executor: ModelRunner | TensorParallelExecutor = (
            self.runner if tensor_parallel is None else TensorParallelExecutor(self.runner, tensor_parallel, options))
        sizing = kv_cache_size(self.executor, config, weight_bytes)
        self.config = dataclasses.replace(  # the pool's size, and max_model_len capped to it where the model's did not fit
            config, cache=dataclasses.replace(config.cache, num_blocks=sizing.num_blocks),
            scheduler=dataclasses.replace(config.scheduler, max_model_len=sizing.max_model_len))
        config = self.config
        self.kv_sizing: KVSizing = sizing
        # what a decode step reads, from what is held (bench serve reports it against the read floor)
        self.decode_weight_bytes = decode_read_bytes(model)
        logger.info(sizing.describe())
        if tensor_parallel is not None:
            logger.info("tensor parallel %d: each rank holds %d of the model's KV heads in a cache of this size, "
                        "so the cache holds %d x the tokens one rank's memory would", tensor_parallel.world,
                        config.model_config.num_kv_heads, tensor_parallel.world)
        self.executor.init_kv_cache(sizing.num_blocks)
        self._closed = False
        opened = open_runner_tier(self.runner, config)
        self.tier: TierStore | None = None if opened is None else opened.store
        kv = KVCacheManager(sizing.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                            tuple(g.window for g in config.model_config.kv_groups()),
                            tier=None if opened is None else opened.index,
                            group_kinds=tuple(g.kind for g in config.model_config.kv_groups()),
                            prompt_tiles=self.runner.prompt_tiles, hash_algo=config.cache.prefix_caching_hash_algo)
        if opened is not None:
            kv.connector.swap_preempted = opened.swap_preempted
        kv.pins.max_blocks = int(config.cache.pinned_prefix_share * sizing.num_blocks)
        self.kv_events: KVEventStream | None = None
        if config.kv_events is not None and config.kv_events.is_on:
            groups = config.model_config.kv_groups()
            specs = group_specs([g.window for g in groups], [g.kind for g in groups])
            self.kv_events = KVEventStream(kv.enable_events(), BatchEncoder(config.kv_events, specs, self.lora_name),
                                           make_publisher(config.kv_events))
        self.scheduler = Scheduler(config.scheduler, kv)
        self.structured = StructuredOutputManager(tokenizer, config.model_config.vocab_size, self.eos_token_ids,
                                                  config.grammar_cache_bytes)
        spec = config.scheduler.speculative
        self.spec: SpecDecodeController | None = None
        if spec is not None:
            proposer = load_draft_model(config, self.runner.attention_backend) if spec.method == "draft" else make_proposer(spec)
            self.spec = SpecDecodeController(spec, config.scheduler.max_model_len, config.scheduler.max_num_batched_tokens,
                                             proposer, self.structured.request_draft_prefix)
            logger.info("speculative decoding: %s drafts, up to %d tokens per request per step, while at most %d "
                        "requests decode", spec.method, spec.num_speculative_tokens, spec.max_batch)
        self._pin_counter = itertools.count()
        self.outputs = OutputProcessor(tokenizer)
        self.step_log = StepLog()  # the last steps, for the dashboard
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_steps = 0
        self._step_thread = StepThread()  # warns when steps move to another thread
        # CPU steps follow the machine's load (octavo/threads.py); ranks of a tensor-parallel group
        # share the cores by design and keep theirs; OCTAVO_ADAPTIVE_THREADS=0 turns it off
        adaptive = (config.device == "cpu" and tensor_parallel is None and torch.get_num_threads() > 1
                    and os.environ.get("OCTAVO_ADAPTIVE_THREADS", "1") != "0")
        self._threads = ThreadGovernor(torch.get_num_threads()) if adaptive else None


    @classmethod
    def from_args(cls, args: EngineArgs | None = None, **kwargs: Any) -> LLMEngine:
        """Load the model (the embedded default when args.model is None) and build an engine."""
        args = args or EngineArgs(**kwargs)
        loaded = load(args)
        try:
            engine = cls(loaded.config, loaded.model, loaded.tokenizer, loaded.weight_bytes, loaded.group)
        except BaseException:
            if loaded.group is not None:
                loaded.group.close()
            raise
        for lora_id, module in enumerate(args.lora_modules, start=1):
            name, path = module.split("=", 1)
            engine.add_lora(LoRARequest(name, lora_id, path))
        if args.pinned_prefix:
            pin_prefix_files(engine.pin_prefix, engine.scheduler.kv_cache, engine.config.cache.pinned_prefix_share,
                             args.pinned_prefix)
        return engine

    def pin_prefix(self, prompt: str | list[int] | dict) -> tuple[int, int]:
        """Compute a prompt's KV and keep its full blocks in the pool for good (never evicted; a
        later prompt that starts with it hits them). `prompt`: text, token ids, or {"messages":
        [...]} rendered with the chat template (no generation prompt: what a chat request with
        those messages first starts with). Steps the engine until it is done (other requests run
        along). Returns (tokens, blocks) it pinned; raises ValueError past the pinned share."""
        if isinstance(prompt, dict):
            prompt = apply_chat_template(self.tokenizer, prompt["messages"], add_generation_prompt=False)
        rid = f"pin-{next(self._pin_counter)}"
        kv = self.scheduler.kv_cache
        before = kv.pins.num_blocks
        self.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), pin=True)
        while rid in self.outputs:
            self.step()
        num_blocks = kv.pins.num_blocks - before
        return num_blocks * kv.block_size, num_blocks

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar-compiling threads; write the
        pool's cached blocks the second tier lacks (a restart serves them) and close it (its
        folder's lock released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.tier is not None:
            flush = self.scheduler.kv_cache.connector.flush_plan() if self.tier.durable else []
            if flush:
                self.runner.store_to_tier(flush)
            self.tier.close()
            logger.info("KV tier closed: %d blocks written at shutdown; %d steps waited for its writer", len(flush),
                        self.tier.num_write_waits)
            self.tier = None
        self.structured.close()
        if isinstance(self.executor, TensorParallelExecutor):
            self.executor.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Load an adapter now (a no-op if this one is loaded; ValueError if LoRA is off or the
        adapter cannot be used). Returns what the prefix cache keys its blocks by: this load of
        it, so an id reused for another adapter after an unload never meets this one's KV."""
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora (--enable-lora)")
        return self.runner.lora.add(lora_request).cache_key

    def has_lora(self, lora_request: LoRARequest) -> bool:
        """Whether exactly this adapter (id, name and path) is loaded now."""
        return self.runner.lora is not None and self.runner.lora.holds(lora_request)

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter; refused (ValueError) while a request still runs with it."""
        if self.runner.lora is None:
            raise ValueError("LoRA is off (start with --enable-lora)")
        if any(r.lora_id == lora_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {lora_id} is in use by unfinished requests")
        self.runner.lora.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded, in id order."""
        return [] if self.runner.lora is None else self.runner.lora.requests()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pin: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError (RequestRefused) if it can never run; nothing is kept.
        `lora_request` runs it with that adapter (loaded on first use).

        With BeamSearchParams the request is a beam search run inside the engine (its beams batch
        with everything else); it yields one final output whose completions are the best beams.
        """
        params = params or SamplingParams()
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = BeamGroup(params, self.eos_token_ids)
            params = params.sequence_params()
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = (prompt, encode_prompt(self.tokenizer, prompt)) if isinstance(prompt, str) else (None, prompt)
        token_ids = check_inputs(token_ids, params, cache_salt, self.config.model_config.vocab_size)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # GrammarError (a ValueError) if it cannot be used
        lora_cache_key = None if lora_request is None else self.add_lora(lora_request)
        arrival = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id if params.n == 1 else child_request_id(request_id, 0),
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            parent_id=None if params.n == 1 else request_id,
            num_samples_pending=params.n,
            beam=beam,
            lora_id=None if lora_request is None else lora_request.lora_int_id,
            lora_cache_key=lora_cache_key,
            pin=pin,
        )
        self.scheduler.add_request(request)
        if params.structured_outputs is not None:  # cached above; kept until the request ends
            self.structured.hold(request_id, params.structured_outputs)
        self.outputs.add_request(request_id, text, token_ids, params, arrival, beam)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """End requests now, wherever they are; their blocks are freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            sequences = self.scheduler.sequences_of(rid)
            ended = self.scheduler.finish_requests(sequences, FinishReason.ABORT)
            if self.spec is not None:
                self.spec.finish(ended)
            self.structured.forget(sequences)
            self.structured.release(rid)
            self.outputs.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    def reset_prefix_cache(self) -> int:
        num_forgotten = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:  # subscribers learn of it now, not at the next step
            self.kv_events.flush()
        return num_forgotten

    def lora_name(self, lora_id: int) -> str | None:
        """An adapter's name (what KV events and lora_requests_info call it), None if unknown."""
        adapter = None if self.runner.lora is None else self.runner.lora.adapters.get(lora_id)
        return None if adapter is None else adapter.name

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, apply the sampled tokens; return outputs of requests that
        changed (finished ones carry finished=True and are forgotten afterwards)."""
        self._step_thread.check()
        if self._threads is not None:
            self._threads.tick()
        start = time.perf_counter()
        drafts = self.spec.propose(self.scheduler.running) if self.spec is not None else None
        sched_out = self.scheduler.schedule(drafts)
        result = self.executor.execute(sched_out, self.structured.step_bitmask(sched_out.scheduled))
        changed = self.scheduler.update(sched_out, result)
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.spec is not None:
            self.spec.observe(sched_out, result)
        self._num_steps += 1
        self._num_generation_tokens += sum(len(t) for t in result.tokens.values())
        num_prompt = sum(
            max(0, min(e.start_pos + e.num_tokens, len(e.prompt_token_ids)) - e.start_pos) for e in sched_out.scheduled
        )
        self._num_prompt_tokens += num_prompt
        processed = self.outputs.process(changed)
        ended = [r for r in changed if r.status is RequestStatus.FINISHED]
        ended += self.scheduler.finish_requests(processed.stopped_seq_ids, FinishReason.STOP)
        self.structured.forget(processed.ended_seq_ids)
        if self.spec is not None:
            self.spec.finish(ended)
        for rid in processed.finished_request_ids:
            self.structured.release(rid)
        if processed.finished_request_ids and not self._answered:
            self._answered = True
            weight_files.release_writes()  # the first answer is out: a first start's files may be written now
        if sched_out.scheduled:  # the dashboard's timeline
            self.step_log.add(StepRecord(self._num_steps, time.time(), time.perf_counter() - start, num_prompt,
                                         sched_out.num_scheduled_tokens - num_prompt, len(sched_out.scheduled),
                                         len(sched_out.preempted_request_ids)))
        return processed.outputs

    def get_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.stats(),
            num_prompt_tokens_total=self._num_prompt_tokens,
            num_generation_tokens_total=self._num_generation_tokens,
            num_steps=self._num_steps,
            spec=None if self.spec is None else dataclasses.replace(
                self.spec.stats, acceptance_counts=list(self.spec.stats.acceptance_counts)),
            lora=self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats | None:
        slots, max_loras = self.runner.lora, self.config.scheduler.max_loras
        if slots is None or max_loras is None:
            return None
        running, waiting = self.scheduler.lora_ids()

        def names(ids: set[int]) -> tuple[str, ...]:
            return tuple(sorted(self.lora_name(i) or str(i) for i in ids))
        return LoRAStats(max_loras, names(running), names(waiting))

