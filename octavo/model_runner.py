"""ModelRunner: SchedulerOutput -> tensors -> model -> sampler -> ModelRunnerOutput. Owns device state.

It holds the weights, the KV-cache tensors (per layer K and V of shape
[num_blocks, block_size, num_kv_heads, head_dim]) and the seeded generators of running requests.
"""

from __future__ import annotations

import dataclasses

import logging
import mmap
import time
from dataclasses import dataclass

import torch

from octavo.config import CacheConfig, ModelConfig
from octavo.cuda_graphs import CudaGraphRunner, graph_batch_sizes
from octavo.kernels import dispatch, kv_format, row_paths
from octavo.kernels.metadata import AttentionMetadata, LoRAMapping, PromptRows, gather_contexts
from octavo.kv_tier import TierStore
from octavo.lora.layers import apply_lora
from octavo.lora.slots import LoRASlots
from octavo.memory import keep_freed_memory_mapped
from octavo.models.layers import CausalLM
from octavo.outputs import ModelRunnerOutput, PooledChunk, ScheduledRequest, SchedulerOutput, TierTransfer
from octavo.sampling.params import SamplingParams
from octavo.sampling.logprobs import TokenLogprob
from octavo.sampling.sampler import SamplingRow, sample
from octavo.sampling.verify import draft_outputs, verify

logger = logging.getLogger("octavo")

PROMPT_LOGPROB_ROWS = 256  # prompt positions scored at once for prompt_logprobs ([rows, vocab] float32)


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> KVCaches:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, row], zero: a row is a token's
    head_dim values in `dtype` (int8: then their float32 scale, kernels/kv_format.py).

    KV groups (ModelConfig.kv_groups) share storage: the i-th layer of every group reads and
    writes the same pair of tensors, each group through its own block table, so a block of the
    pool holds one group's layers (one tensor pair per layer for a model with one group).

    On the CPU the whole pool is one anonymous memory map: the kernel hands out zero pages as they
    are first written, so an idle server holds none of it and a busy one holds what its requests
    have used (the block pool hands out low block ids first). Zero-filling 4 GiB at start made an
    idle `octavo serve` hold ~4.9 GiB resident. On CUDA the memory is taken now: it was budgeted.
    """
    groups = model_config.kv_groups()
    per_block = model_config.kv_slots_per_block()  # K/V pairs one block holds
    if dtype == torch.int8 and any(group.kind == "conv" for group in groups):
        raise ValueError("an int8 KV cache is not built for models with short-convolution layers (LFM2): "
                         "use --kv-cache-dtype float32, bfloat16 or float16")
    row = kv_format.row_elements(dtype, model_config.head_dim)
    shape = (num_blocks, block_size, model_config.num_kv_heads, row)
    numel = num_blocks * block_size * model_config.num_kv_heads * row
    num_tensors = 2 * per_block
    if device.type != "cpu":
        views = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_tensors)]
    else:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        pool = mmap.mmap(-1, max(1, num_tensors * numel * itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(pool, dtype=torch.uint8).view(dtype)  # [num_tensors * numel]; keeps `pool` alive
        views = [flat[i * numel : (i + 1) * numel].view(shape) for i in range(num_tensors)]
    # a short-convolution layer (LFM2) takes conv_slots pairs: its tuple holds all of their tensors
    width = {layer: model_config.conv_slots() if group.kind == "conv" else 1 for group in groups for layer in group.layers}
    first = {layer: i * width[layer] for group in groups for i, layer in enumerate(group.layers)}
    return [tuple(views[2 * first[layer] : 2 * (first[layer] + width[layer])]) for layer in range(model_config.num_layers)]


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How every rank builds its ModelRunner: rank 0 builds its own from these and sends them to
    the other ranks of a tensor-parallel group, so that all runners are the same."""

    block_size: int
    eos_token_ids: tuple[int, ...]
    device: str = "cpu"
    kv_dtype: str = "float32"  # the cache's (KV_CACHE_DTYPES)
    dtype: str = "float32"  # the activations'
    attention_backend: str = "auto"
    enforce_eager: bool = True
    max_num_seqs: int = 1
    max_model_len: int = 1
    max_loras: int | None = None
    max_lora_rank: int = 16

    def build(self, model: CausalLM, model_config: ModelConfig, rank: int = 0, device: str | None = None) -> ModelRunner:
        """This rank's runner over its model (shard); `device`: the rank's own (cuda:r), if not the options'."""
        return ModelRunner(model, model_config, CacheConfig(block_size=self.block_size), self.eos_token_ids,
                           device or self.device, getattr(torch, self.kv_dtype), self.attention_backend,
                           dtype=getattr(torch, self.dtype),
                           enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
                           max_model_len=self.max_model_len, max_loras=self.max_loras,
                           max_lora_rank=self.max_lora_rank, rank=rank)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        eos_token_ids: tuple[int, ...],
        device: str = "cpu",
        kv_dtype: torch.dtype = torch.float32,
        attention_backend: str = "auto",
        enforce_eager: bool = True,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
        max_loras: int | None = None,
        max_lora_rank: int = 16,
        rank: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        """The KV cache comes with `init_kv_cache` (at once if `cache_config.num_blocks` is set).
        `rank` > 0: a tensor-parallel rank's runner; it runs every step as rank 0's does (the
        collectives inside the sharded layers keep them together) but does not sample. `kv_dtype`:
        what the cache holds (kernels/kv_format.py); `dtype`: the model's activations (None: kv_dtype
        where that is a floating dtype, else float32)."""
        self.model = model
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids
        self.rank = rank
        self.kv_caches: KVCaches = []
        self._generators: dict[str, torch.Generator] = {}
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kv_dtype = kv_dtype
        self._max_num_seqs, self._max_model_len = max_num_seqs, max_model_len
        if dtype is None:
            dtype = kv_dtype if kv_dtype.is_floating_point else torch.float32
        self.attention_backend = dispatch.select_attention_backend(attention_backend, self.device, kv_dtype, dtype)
        # int8 layers: long prompts' rows through AMX-BF16 tiles where the CPU runs them
        self.prompt_tiles = self.device.type == "cpu" and dispatch.prompt_tiles_enabled(model)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()
        self.lora: LoRASlots | None = None
        if max_loras is not None:  # wraps the model's projections in place (see octavo.lora.layers)
            layers = apply_lora(model, model_config, max_loras, max_lora_rank)
            self.lora = LoRASlots(layers, model_config, max_loras, max_lora_rank)
        self.tier: TierStore | None = None  # the second KV tier (attach_tier)
        self.graphs: CudaGraphRunner | None = None
        self._capture_graphs = False
        if not enforce_eager and self.lora is not None:
            logger.warning("CUDA graphs are not captured with LoRA on: running eagerly")
        elif not enforce_eager and len(model_config.kv_groups()) > 1:
            logger.warning("CUDA graphs are not captured for a model with sliding-window KV groups: running eagerly")
        elif not enforce_eager and self.device.type == "cuda" and self.attention_backend == "triton":
            self._capture_graphs = True
        elif not enforce_eager:
            logger.warning("CUDA graphs need CUDA and the triton backend (here %s, %s): running eagerly",
                           self.device.type, self.attention_backend)
        if cache_config.num_blocks is not None:
            self.init_kv_cache(cache_config.num_blocks)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache of `num_blocks` blocks (once); with CUDA graphs on, capture decode
        steps of up to max_num_seqs requests of max_model_len over it."""
        if self.kv_caches:
            raise ValueError("the KV cache is already allocated")
        self.kv_caches = allocate_kv_caches(self.model_config, num_blocks, self.block_size, self._kv_dtype, self.device)
        if self._capture_graphs:
            max_blocks = -(-self._max_model_len // self.block_size)
            self.graphs = CudaGraphRunner(self.model, self.kv_caches, graph_batch_sizes(self._max_num_seqs), max_blocks,
                                          self.device)

    def _decode_workspace(self, num_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the decode gathers, grown (by half again) when a step needs more."""
        if self._workspace is None or self._workspace[0].numel() < num_elements:
            size = max(num_elements, int(1.5 * (self._workspace[0].numel() if self._workspace else 0)))
            self._workspace = (
                torch.empty(size, dtype=self._kv_dtype, device=self.device),
                torch.empty(size, dtype=self._kv_dtype, device=self.device),
            )
        return self._workspace

    # ---- inputs ------------------------------------------------------------------------------

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _tables(self, entries: list[ScheduledRequest], group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One KV group's slot mapping [num_tokens] and block tables [num_seqs, max_blocks]."""
        bs = self.block_size
        max_blocks = max(-(-(e.start_pos + e.num_tokens) // bs) for e in entries)
        slots: list[int] = []
        tables: list[list[int]] = []
        for e in entries:
            block_ids = e.block_tables[group]
            slots.extend(self._slots(block_ids, e.start_pos, e.start_pos + e.num_tokens))
            table = block_ids[:max_blocks]
            tables.append(table + [0] * (max_blocks - len(table)))
        return (torch.tensor(slots, dtype=torch.long, device=self.device),
                torch.tensor(tables, dtype=torch.int32, device=self.device))

    def prepare(self, entries: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the scheduled tokens (single-token requests first) into input tensors.

        `entries` must already be in that order (see `execute`). With several KV groups, the
        metadata of each group (its own slots and block tables) is in `meta.group_metas`.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        query_starts: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for e in entries:
            start, end = e.start_pos, e.start_pos + e.num_tokens
            query_starts.append(len(input_ids))
            query_lens.append(e.num_tokens)
            context_lens.append(end)
            input_ids.extend(e.token_ids)
            positions.extend(range(start, end))
        slot_mapping, block_tables = self._tables(entries, 0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_starts=torch.tensor(query_starts, dtype=torch.int32, device=self.device),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            num_decode_tokens=sum(1 for n in query_lens if n == 1),
            backend=self.attention_backend,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )
        if self.lora is not None:
            meta.lora = self._lora_mapping(entries, query_starts)
        if self.prompt_tiles:
            meta.prompt_rows = self._prompt_rows(entries, query_starts, len(input_ids))
        num_groups = len(self.model_config.kv_groups())
        if num_groups > 1:
            meta.group_metas = [meta] + [
                dataclasses.replace(meta, slot_mapping=slots, block_tables=tables)
                for slots, tables in (self._tables(entries, g) for g in range(1, num_groups))
            ]
        if self.attention_backend == "reference":
            nd = meta.num_decode_tokens
            size = nd * max(context_lens[:nd], default=0) * self.model_config.num_kv_heads * self.model_config.head_dim
            workspace = self._decode_workspace(size) if nd else None
            groups = self.model_config.kv_groups()
            for g, group_meta in enumerate(meta.group_metas or [meta]):
                if groups[g].kind == "attention":  # (a convolution reads its few slots itself)
                    group_meta.gathered = gather_contexts(group_meta, self.block_size, workspace)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta

    @staticmethod
    def _prompt_rows(entries: list[ScheduledRequest], query_starts: list[int], num_tokens: int) -> PromptRows | None:
        """The rows the tiles compute (kernels/row_paths.py: prompt positions of long prompts, the
        requests' own properties: the choice never depends on the batch)."""
        spans = []
        for e, first in zip(entries, query_starts):
            tiled = row_paths.tiled_prompt_tokens(len(e.prompt_token_ids), True)
            if e.start_pos < tiled:
                spans.append((first, first + min(e.num_tokens, tiled - e.start_pos)))
        if not spans:  # a decode step: no tensor to build
            return None
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        for start, end in spans:
            mask[start:end] = True
        return PromptRows.of(mask)

    def _lora_mapping(self, entries: list[ScheduledRequest], query_starts: list[int]) -> LoRAMapping | None:
        """The step's rows grouped by adapter slot (swapping adapters into slots as needed)."""
        ids = {e.lora_id for e in entries if e.lora_id is not None}
        if not ids:
            return None
        slot_of = self.lora.activate(ids)
        rows: dict[int, list[int]] = {}
        for e, start in zip(entries, query_starts):
            if e.lora_id is not None:
                rows.setdefault(slot_of[e.lora_id], []).extend(range(start, start + e.num_tokens))
        return LoRAMapping([(slot, torch.tensor(r, dtype=torch.long, device=self.device)) for slot, r in rows.items()])

    # ---- one step ----------------------------------------------------------------------------

    def _generator(self, seq_id: str, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((seed + index) % 2**64)  # int64 seed + sample index stays in range
            self._generators[seq_id] = gen
        return gen

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, grammar: tuple[list[str], torch.Tensor] | None = None) -> ModelRunnerOutput:
        """One forward and sampling. `grammar` = (sequence ids, token bitmask [k, words]): those
        sequences sample only tokens their structured-output grammar allows.

        With a second KV tier, the blocks the step evicts are copied out first (the step may
        overwrite them). Loads of the requests this step computes (each load names the one
        request whose table the block joins) are read, checked and copied in before the forward;
        a request whose load failed its checksum is left out of the step and named in
        `left_out` (the scheduler rolls it back). Other loads (of requests that take more from
        the cache next step, or were preempted) are read meanwhile and copied in before it returns. The copies are handed to the tier after
        the forward (its checksums then cost no forward thread a wait), and finished writes are
        reported."""
        if self.tier is None:
            return self._execute(sched, grammar)
        copied = self._copy_out(sched.tier_stores) if sched.tier_stores else None
        computing = {e.request_id for e in sched.scheduled}
        now = [t for t in sched.tier_loads if t.request_id in computing]
        later = [t for t in sched.tier_loads if t.request_id not in computing]
        waited = time.perf_counter()
        loading_now = self._start_loads(now) if now else None  # first in the reader's queue
        loading = self._start_loads(later) if later else None
        loaded = self._finish_loads(now, *loading_now) if now else {}
        waited = time.perf_counter() - waited if now else 0.0
        left_out = sorted({t.request_id for t in now if not loaded[t.block_id]})
        if left_out:
            sched, grammar = _without(set(left_out), sched, grammar)
        out = self._execute(sched, grammar)
        out.left_out = left_out
        if copied is not None:
            self.tier.submit_writes([t.slot for t in sched.tier_stores], [t.key for t in sched.tier_stores], copied[1])
        if loading is not None:
            loaded |= self._finish_loads(later, *loading)
        out.tier_loaded, out.tier_read_seconds = loaded, waited
        out.tier_stored = self.tier.take_finished_writes()
        return out

    # ---- the second KV tier ------------------------------------------------------------------

    def attach_tier(self, tier: TierStore) -> None:
        """Use `tier` for the blocks the scheduler stores and loads (its slots hold one pool block)."""
        if tier.slot_bytes != self.tier_block_bytes():
            raise ValueError(f"the tier's slots hold {tier.slot_bytes} B, a pool block {self.tier_block_bytes()} B")
        self.tier = tier

    def host_buffer(self, num_bytes: int):
        """A writable host buffer of `num_bytes` (pinned on CUDA: copies to and from the device are
        DMA) for a tier in host memory."""
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda").numpy()

    def _tier_tensors(self) -> list[torch.Tensor]:
        """The pool's storage, one tensor per (layer of a block, K or V): what one block spans."""
        return [t for layer in self.model_config.kv_groups()[0].layers for t in self.kv_caches[layer]]

    def tier_block_bytes(self) -> int:
        return self.model_config.kv_bytes_per_block(self.block_size, kv_format.kv_dtype_name(self._kv_dtype))

    def _host_blocks(self, num_blocks: int) -> tuple[torch.Tensor, list[memoryview]]:
        """A host buffer [num_blocks, tensors, block_size, kv_heads, head_dim] and a writable
        byte view of each block in it."""
        tensors = self._tier_tensors()
        buf = torch.empty((num_blocks, len(tensors), *tensors[0].shape[1:]), dtype=self._kv_dtype,
                          pin_memory=self.device.type == "cuda")
        rows = buf.view(num_blocks, -1).view(torch.uint8)  # [num_blocks, block bytes]
        return buf, [memoryview(rows[i].numpy()) for i in range(num_blocks)]

    def store_to_tier(self, stores: list[TierTransfer]) -> None:
        """Copy the blocks out of the pool and queue their writes; reported by the tier's
        take_finished_writes."""
        _, views = self._copy_out(stores)
        self.tier.submit_writes([t.slot for t in stores], [t.key for t in stores], views)

    def _copy_out(self, stores: list[TierTransfer]) -> tuple[torch.Tensor, list[memoryview]]:
        """The blocks' bytes, copied out of the pool into a host buffer (and a view of each)."""
        buf, views = self._host_blocks(len(stores))
        ids = torch.tensor([t.block_id for t in stores], dtype=torch.long, device=self.device)
        for i, tensor in enumerate(self._tier_tensors()):
            buf[:, i].copy_(tensor.index_select(0, ids))  # [n, block_size, kv_heads, head_dim]
        return buf, views

    def _start_loads(self, loads: list[TierTransfer]):
        buf, views = self._host_blocks(len(loads))
        return buf, views, self.tier.submit_reads([t.slot for t in loads], [t.key for t in loads], views)

    def _finish_loads(self, loads: list[TierTransfer], buf: torch.Tensor, views, future) -> dict[int, bool]:
        """Wait for the reads, copy the blocks that passed their checksum into the pool."""
        ok = future.result()
        rows = [i for i, good in enumerate(ok) if good]
        if rows:
            ids = torch.tensor([loads[i].block_id for i in rows], dtype=torch.long, device=self.device)
            picked = buf[torch.tensor(rows, dtype=torch.long)].to(self.device)  # [n_ok, tensors, ...]
            for i, tensor in enumerate(self._tier_tensors()):
                tensor.index_copy_(0, ids, picked[:, i])
        return {t.block_id: good for t, good in zip(loads, ok)}

    def _execute(self, sched: SchedulerOutput, grammar: tuple[list[str], torch.Tensor] | None) -> ModelRunnerOutput:
        for rid in sched.finished_request_ids:
            self._generators.pop(rid, None)
        dispatch.copy_blocks(self.kv_caches, sched.copies)
        if not sched.scheduled:
            return ModelRunnerOutput(tokens={})
        entries = sorted(sched.scheduled, key=lambda e: e.num_tokens != 1)  # stable: decodes first
        input_ids, positions, meta = self.prepare(entries)

        last_rows: list[int] = []  # the hidden-state row each sample reads: its request's last token
        rows: list[SamplingRow] = []
        seq_ids: list[str] = []  # per sampling row (a sequence with k drafts has k + 1 rows, in order)
        offset = 0
        for e in entries:
            offset += e.num_tokens
            for row in e.samples:
                generator = self._generator(row.seq_id, e.sampling_params.seed, row.sample_index) if self.rank == 0 else None
                num_drafts = len(row.draft_token_ids)
                for j, output in enumerate(draft_outputs(row.output_token_ids, row.draft_token_ids)):
                    last_rows.append(offset - 1 - num_drafts + j)  # row j: as if drafts[:j] were output
                    seq_ids.append(row.seq_id)
                    rows.append(SamplingRow(params=e.sampling_params, prompt_token_ids=e.prompt_token_ids,
                                            output_token_ids=output, eos_token_ids=self.eos_token_ids,
                                            generator=generator))
        row_index = torch.tensor(last_rows, dtype=torch.long, device=self.device) if rows else None
        if self.graphs is not None and self.graphs.can_run(input_ids.shape[0], meta):
            hidden = self.graphs.run(input_ids, positions, meta)  # [num_tokens, hidden]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        prompt_logprobs = self._prompt_logprobs(entries, hidden)
        pooled = self._pooled(entries, hidden)
        if not rows:
            return ModelRunnerOutput(tokens={}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        logits = self.model.compute_logits(hidden[row_index])  # [num_rows, vocab] float32
        if self.rank != 0:  # the logits' gather is a collective every rank joins; rank 0 samples
            return ModelRunnerOutput(tokens={})
        allowed = None
        if grammar is not None and grammar[0]:
            allowed = (torch.tensor(_grammar_rows(seq_ids, grammar[0]), dtype=torch.long, device=self.device), grammar[1])
        spec = {e.samples[0].seq_id: e.samples[0].draft_token_ids for e in entries if e.samples and e.samples[0].draft_token_ids}
        states: dict[int, object] | None = {i: None for i, sid in enumerate(seq_ids) if sid in spec} if spec else None
        tokens, logprobs = sample(logits, rows, allowed, states)
        out = ModelRunnerOutput(tokens={}, prompt_logprobs=prompt_logprobs, pooled=pooled)
        for sid, kept in verify(seq_ids, tokens, logprobs, spec).items():
            out.tokens[sid] = kept.tokens
            if kept.logprobs is not None:
                out.logprobs[sid] = kept.logprobs
            state = states.get(kept.rewind_row) if states is not None and kept.rewind_row is not None else None
            if state is not None:  # its generator as if it had drawn only for the rows kept
                self._generators[sid].set_state(state)
        return out

    def _pooled(self, entries: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, PooledChunk]:
        """For embedding requests: what each one's pooling takes from this step's chunk (see
        ModelRunnerOutput.pooled), in float32."""
        out: dict[str, PooledChunk] = {}
        offset = 0
        for e in entries:
            pooling = e.sampling_params.pooling
            if pooling is not None:
                rows = hidden[offset : offset + e.num_tokens]  # [chunk, hidden]
                end, num_prompt = e.start_pos + e.num_tokens, len(e.prompt_token_ids)
                value = None
                if pooling.pooling_type == "mean":
                    value = rows.float().sum(dim=0)
                elif pooling.pooling_type == "last" and end == num_prompt:
                    value = rows[-1].float()
                elif pooling.pooling_type == "cls" and e.start_pos == 0:
                    value = rows[0].float()
                if value is not None:
                    out[e.request_id] = PooledChunk(e.start_pos, e.num_tokens, value.tolist())
            offset += e.num_tokens
        return out

    def _prompt_logprobs(self, entries: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """For requests asking prompt_logprobs: the logprob of each prompt token this step's chunk
        predicts (position p's logits score prompt token p + 1) and its top-k alternatives.
        Rows are scored PROMPT_LOGPROB_ROWS at a time, so a long chunk never holds [chunk, vocab]."""
        out: dict[str, tuple[int, list[TokenLogprob]]] = {}
        offset = 0
        for e in entries:
            k = e.sampling_params.prompt_logprobs
            first, num_prompt = e.start_pos, len(e.prompt_token_ids)
            end = min(first + e.num_tokens, num_prompt - 1)  # positions whose next token is a prompt token
            if k is not None and end > first:
                entries_out: list[TokenLogprob] = []
                for lo in range(first, end, PROMPT_LOGPROB_ROWS):
                    hi = min(end, lo + PROMPT_LOGPROB_ROWS)
                    lp = torch.log_softmax(self.model.compute_logits(hidden[offset + lo - first : offset + hi - first]), dim=-1)
                    targets = torch.tensor(e.prompt_token_ids[lo + 1 : hi + 1], dtype=torch.long, device=lp.device)
                    chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
                    top = torch.topk(lp, k, dim=-1) if k > 0 else None
                    ids = top.indices.tolist() if top is not None else [[]] * (hi - lo)
                    vals = top.values.tolist() if top is not None else [[]] * (hi - lo)
                    for j, t in enumerate(targets.tolist()):
                        entries_out.append(TokenLogprob(t, chosen[j], dict(zip(ids[j], vals[j]))))
                out[e.request_id] = (first + 1, entries_out)
            offset += e.num_tokens
        return out

    @torch.inference_mode()
    def profile_activation_peak(self, max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
        """Run one worst-case step through `prepare` (max_num_batched_tokens prompt tokens in
        requests of at most max_model_len, and logits for max_num_seqs rows) on a scratch KV cache
        just big enough, and return the activation peak in bytes beyond the weights and that
        scratch (CUDA; on the CPU the step runs and None is returned: there is no allocator peak
        to read). Every rank of a tensor-parallel group runs it (its collectives)."""
        dev, bs = self.device, self.block_size
        lens = [min(self._max_model_len, max_num_batched_tokens - start)
                for start in range(0, max_num_batched_tokens, self._max_model_len)]
        entries, next_block = [], 0
        for i, n in enumerate(lens):
            nb = -(-n // bs)
            tokens = torch.randint(0, self.model_config.vocab_size, (n,)).tolist()
            block_ids = list(range(next_block, next_block + nb))  # every group on the same scratch blocks
            tables = [block_ids] * len(self.model_config.kv_groups())
            entries.append(ScheduledRequest(f"profile-{i}", tokens, 0, tables, SamplingParams(), [], tokens))
            next_block += nb
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        kv = allocate_kv_caches(self.model_config, next_block, bs, self._kv_dtype, dev)
        kv_bytes = len({t.data_ptr() for pair in kv for t in pair}) * kv[0][0].numel() * kv[0][0].element_size()
        input_ids, positions, meta = self.prepare(sorted(entries, key=lambda e: e.num_tokens != 1))
        hidden = self.model(input_ids, positions, kv, meta)  # [num_tokens, hidden]
        rows = torch.arange(max_num_seqs, device=dev) % max_num_batched_tokens
        logits = self.model.compute_logits(hidden[rows])  # [max_num_seqs, vocab] float32
        torch.sort(logits, dim=-1, descending=True)  # the top-p sort's copies, as a sampling step makes
        if dev.type != "cuda":
            return None
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base - kv_bytes
        del kv, hidden, logits
        self._workspace = None
        torch.cuda.empty_cache()
        return max(0, peak)


def _grammar_rows(seq_ids: list[str], grammar_ids: list[str]) -> list[int]:
    """The sampling row of each grammar bitmask row: a sequence's mask rows follow its sampling
    rows in order (one per position, k + 1 with k drafts)."""
    first: dict[str, int] = {}
    for i, sid in enumerate(seq_ids):
        first.setdefault(sid, i)
    seen: dict[str, int] = {}
    out = []
    for sid in grammar_ids:
        out.append(first[sid] + seen.get(sid, 0))
        seen[sid] = seen.get(sid, 0) + 1
    return out


def _without(left_out: set[str], sched: SchedulerOutput, grammar):
    """The step without the requests `left_out` (and their grammar rows)."""
    keep = [e for e in sched.scheduled if e.request_id not in left_out]
    sched = dataclasses.replace(sched, scheduled=keep)
    if grammar is not None:
        kept_ids = {sid for e in keep for sid in e.sample_ids}
        rows = [i for i, sid in enumerate(grammar[0]) if sid in kept_ids]
        grammar = ([grammar[0][i] for i in rows], grammar[1][rows])
    return sched, grammar
