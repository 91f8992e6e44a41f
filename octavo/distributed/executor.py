"""TensorParallelGroup: the worker processes that hold ranks 1..N-1 of a tensor-parallel model,
and the one message per step that keeps them in lock-step with the engine (rank 0).

torch.distributed with gloo on the CPU (a torchrun-style TCP rendezvous). The scheduler and the
KV-cache manager stay single, in the engine; rank 0's ModelRunner broadcasts each step's inputs
(token ids, positions, the attention metadata, block copies, which rows to sample), then every
rank runs the same forward on its shard; the all-reduces inside the row-parallel layers and the
logits gather keep them together. A worker that dies makes the next step raise, never hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger("octavo")
TIMEOUT = datetime.timedelta(seconds=120)  # a collective that waits longer than this fails the engine


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its shard exactly as rank 0 built its own."""

    model_dir: str
    dtype: str
    threads: int = 1
    device: str = "cpu"  # "cuda": NCCL, one GPU per rank (rank r on cuda:r of its node)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device rank `rank` works on: the CPU, or its node-local GPU (LOCAL_RANK under torchrun)."""
    if not device.startswith("cuda"):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def on_device(step: tuple, device: torch.device) -> tuple:
    """A step's tensors moved to `device` (steps travel between ranks as CPU tensors: a pickled GPU
    tensor would come back on the sender's GPU)."""
    ids, positions, meta, rows = step
    fields = {f: getattr(meta, f).to(device) for f in ("slot_mapping", "block_tables", "query_starts", "query_lens",
                                                         "context_lens")}
    meta = dataclasses.replace(meta, gathered=None, **fields)
    return ids.to(device), positions.to(device), meta, None if rows is None else rows.to(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    def __init__(self, world: int, spec: WorkerSpec, init_method: str | None = None, rank: int = 0,
                 spawn: bool = True) -> None:
        """Rank 0: start ranks 1..world-1 as processes here (spawn), or join ranks started elsewhere
        (torchrun: spawn False, init_method from MASTER_ADDR / MASTER_PORT); then join the group."""
        self.world, self.rank = world, rank
        self.threads_before = torch.get_num_threads()  # restored on close (the engine lowers it per rank)
        init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[Any] = []
        if spawn:
            ctx = mp.get_context("spawn")
            for r in range(1, world):
                p = ctx.Process(target=worker_main, args=(r, world, init_method, spec), daemon=True,
                                name=f"octavo-tp-worker-{r}")
                p.start()
                self.procs.append(p)
        self.device = rank_device(spec.device, rank)
        backend = backend_for(spec.device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
        logger.info("tensor parallel: %d ranks joined (%s%s)", world, backend, ", workers spawned here" if spawn else "")

    def check_workers(self) -> None:
        dead = [(p.name, p.exitcode) for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {dead[0][0]} died (exit code {dead[0][1]}): the engine cannot continue")

    def send(self, message: tuple) -> None:
        """Every worker receives `message` (the same broadcast they wait in); a step's tensors go as
        CPU tensors."""
        self.check_workers()
        if message[0] == "step" and message[2] is not None and self.device.type != "cpu":
            message = (message[0], message[1], on_device(message[2], torch.device("cpu")))
        dist.broadcast_object_list([message], src=0)

    def close(self) -> None:
        """Stop the workers and leave the group (a later engine in this process may form another)."""
        if not dist.is_initialized():
            return
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([None], src=0)
                # every rank has the stop before any tears its connections down: a rank destroying
                # the group while another still reads from it made gloo abort that one (seen under
                # load with torchrun: "terminate called without an active exception")
                dist.barrier()
        finally:
            for p in self.procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            torch.set_num_threads(self.threads_before)


def worker_main(rank: int, world: int, init_method: str, spec: WorkerSpec) -> None:
    """A worker's whole life: join, build its shard, then mirror rank 0's steps until told to stop."""
    from octavo.distributed.layers import local_config, shard_model
    from octavo.kernels import dispatch
    from octavo.kernels.metadata import gather_contexts
    from octavo.models.loader import load_model

    torch.set_num_threads(spec.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    device = rank_device(spec.device, rank)
    dist.init_process_group(backend_for(spec.device), init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    dtype = getattr(torch, spec.dtype)
    model, cfg = load_model(Path(spec.model_dir), dtype=dtype, device=str(device), quantization="none")
    shard_model(model, rank, world)
    local = local_config(cfg, world)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
            if message is None:
                dist.barrier()  # see TensorParallelGroup.close
                break
            if message[0] == "init":
                num_blocks, block_size = message[1], message[2]
                shape = (num_blocks, block_size, local.num_kv_heads, local.head_dim)
                kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                             for _ in range(local.num_layers)]
                continue
            _, copies, step = message
            dispatch.copy_blocks(kv_caches, copies)
            if step is None:
                continue
            ids, positions, meta, rows = on_device(step, device)
            if meta.backend == "reference":
                meta.gathered = gather_contexts(meta, kv_caches[0][0].shape[1])
            with torch.inference_mode():
                hidden = model(ids, positions, kv_caches, meta)
                if rows is not None:
                    model.compute_logits(hidden[rows])
    finally:
        dist.destroy_process_group()


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun for more than one rank
    (its env rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world


def run_worker_from_env(model_dir: str, dtype: str, tensor_parallel_size: int, device: str = "cpu") -> None:
    """A rank > 0 started by torchrun (on this node or another): be a worker of rank 0's engine."""
    rank, world = torchrun_rank()
    if world != tensor_parallel_size:
        raise ValueError(f"torchrun started {world} ranks but --tensor-parallel-size is {tensor_parallel_size}")
    worker_main(rank, world, "env://", WorkerSpec(model_dir, dtype, torch.get_num_threads(), device))
