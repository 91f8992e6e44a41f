"""CUDA graphs of decode-only steps: one captured forward per padded batch size, replayed with the
step's inputs copied into static buffers. Owned by the ModelRunner.

Padding rows (batch size rounded up to a captured size) have context length 0 and slot -1, so the
Triton kernels neither read nor write the KV cache for them; their hidden rows are discarded.
`DecodeBuffers` holds that padding logic apart from the capture, so the CPU tests can check it
(a padded forward through the buffers equals the plain forward) without a GPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from octavo.kernels.metadata import AttentionMetadata

logger = logging.getLogger("octavo")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's capture list), and
    max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeBuffers:
    """Static inputs of decode steps of up to `batch_sizes[-1]` requests, and their metadata."""

    def __init__(self, batch_sizes: list[int], max_blocks_per_seq: int, device: torch.device) -> None:
        self.batch_sizes = sorted(batch_sizes)
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_starts = torch.arange(n, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)

    def meta(self, size: int) -> AttentionMetadata:
        """The metadata of a padded batch of `size` rows (views of the buffers)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_starts=self.query_starts[:size],
            query_lens=self.query_lens[:size],
            context_lens=self.context_lens[:size],
            num_decode_tokens=size,
            backend="triton",
            max_query_len=1,
            allow_split_kv=False,
        )

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step of at most the largest size, with block tables that fit."""
        return (
            meta.num_decode_tokens == num_tokens
            and num_tokens <= self.batch_sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a step's inputs in, pad to the smallest size that holds them, return that size."""
        n = input_ids.shape[0]
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:size].zero_()
        return size


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        """Capture `model`'s forward for decode-only batches of each size (a warm-up run before
        each capture compiles the Triton kernels outside the graph)."""
        self.buffers = DecodeBuffers(batch_sizes, max_blocks_per_seq, device)
        b = self.buffers
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(b.batch_sizes):  # largest first: the pool is sized once
                meta = b.meta(size)
                model(b.input_ids[:size], b.positions[:size], kv_caches, meta)  # warm-up (compiles)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(b.input_ids[:size], b.positions[:size], kv_caches, meta)
                self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        self.num_bytes = before - torch.cuda.mem_get_info(device)[0]
        logger.info("CUDA graphs: %d decode batch sizes up to %d captured, %.0f MiB",
                    len(b.batch_sizes), b.batch_sizes[-1], self.num_bytes / 2**20)

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        return self.buffers.fits(num_tokens, meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that holds this step -> hidden states [num_tokens, hidden]."""
        size = self.buffers.fill(input_ids, positions, meta)
        graph, hidden = self._graphs[size]
        graph.replay()
        self.num_replays += 1
        return hidden[: input_ids.shape[0]]
