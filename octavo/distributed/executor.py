"""Tensor parallelism's ranks: every rank runs the same ModelRunner over its shard of the model.

`TensorParallelGroup` starts ranks 1..N-1 as worker processes (or joins ranks torchrun started,
on this machine or others) over torch.distributed: gloo on the CPU, NCCL on GPUs (unverified).
The scheduler and the KV-cache manager stay single, in the engine; `TensorParallelExecutor` is
rank 0's face of the group: each runner call (build the KV cache, the profiling step, a step's
`SchedulerOutput`) is broadcast once as a typed `RunnerCall`, then run here; each worker runs the
same call on its own runner, and the all-reduces inside the row-parallel layers and the logits
gather keep the ranks together. Only rank 0 samples. A worker that dies makes the next call
raise, never hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from octavo.config import ModelConfig
from octavo.model_runner import ModelRunner, RunnerOptions
from octavo.outputs import ModelRunnerOutput, SampleRow, SchedulerOutput

if TYPE_CHECKING:
    from octavo.models.layers import CausalLM

logger = logging.getLogger("octavo")
TIMEOUT = datetime.timedelta(seconds=120)  # a collective that waits longer than this fails the engine


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker needs to build its shard exactly as rank 0 built its own."""

    model_dir: str
    dtype: str
    threads: int = 1
    device: str = "cpu"  # "cuda": NCCL, one GPU per rank (rank r on cuda:r of its node)
    quantization: str = "none"  # "auto": a GGUF's quantized blocks, sharded by whole blocks
    activation_dtype: str = "float32"  # quantized layers' activations (config.ACTIVATION_DTYPES)


@dataclass(frozen=True, slots=True)
class RunnerCall:
    """One call every rank's runner makes, in the same order: what rank 0 broadcasts."""

    method: str  # "init_kv_cache" | "profile_activation_peak" | "execute"
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class StartRunner:
    """The first message: how to build the runner (the same options as rank 0's)."""

    options: RunnerOptions


_WORKER_CALLS = ("init_kv_cache", "profile_activation_peak", "execute")


def load_shard(spec: WorkerSpec, rank: int, world: int) -> tuple[CausalLM, ModelConfig]:
    """This rank's shard of the model and the config it sees (its share of the heads), built the
    same way on every rank: load (quantized blocks left in GGUF layout), shard, then pack."""
    from octavo.distributed.layers import check_divisible, local_config, shard_model
    from octavo.models.loader import load_model, prepare_quantized_layers

    device = rank_device(spec.device, rank)
    model, cfg = load_model(Path(spec.model_dir), dtype=getattr(torch, spec.dtype), device=str(device),
                            quantization=spec.quantization, prepare_quantized=False,
                            activation_dtype=spec.activation_dtype)
    check_divisible(cfg, world)
    shard_model(model, rank, world)
    prepare_quantized_layers(model, spec.activation_dtype)
    return model, local_config(cfg, world)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device rank `rank` works on: the CPU, or its node-local GPU (LOCAL_RANK under torchrun)."""
    if not device.startswith("cuda"):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


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
                p = ctx.Process(target=serve_rank, args=(r, world, init_method, spec), daemon=True,
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

    def broadcast(self, message: StartRunner | RunnerCall) -> None:
        """Every worker receives `message` (the same broadcast they wait in)."""
        self.check_workers()
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


def serve_rank(rank: int, world: int, init_method: str, spec: WorkerSpec) -> None:
    """A worker's whole life: join, build its shard and its runner as rank 0 did, then make every
    runner call rank 0 makes, in the same order, until told to stop."""
    torch.set_num_threads(spec.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads))
    device = rank_device(spec.device, rank)
    dist.init_process_group(backend_for(spec.device), init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        model, local = load_shard(spec, rank, world)
        runner: ModelRunner | None = None
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            message = box[0]
            if message is None:
                dist.barrier()  # see TensorParallelGroup.close
                break
            if isinstance(message, StartRunner):
                runner = message.options.build(model, local, rank, str(device))
            elif isinstance(message, RunnerCall) and message.method in _WORKER_CALLS and runner is not None:
                getattr(runner, message.method)(*message.args)
            else:
                raise RuntimeError(f"tensor-parallel worker {rank}: unexpected message {message!r}")
    finally:
        dist.destroy_process_group()


class TensorParallelExecutor:
    """Rank 0's runner with the group behind it: each call goes to every rank, then runs here.
    The engine calls it as it would call its ModelRunner."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, options: RunnerOptions) -> None:
        self.runner, self.group = runner, group
        group.broadcast(StartRunner(options))

    def init_kv_cache(self, num_blocks: int) -> None:
        self.group.broadcast(RunnerCall("init_kv_cache", (num_blocks,)))
        self.runner.init_kv_cache(num_blocks)

    def profile_activation_peak(self, max_num_batched_tokens: int, max_num_seqs: int) -> int | None:
        self.group.broadcast(RunnerCall("profile_activation_peak", (max_num_batched_tokens, max_num_seqs)))
        return self.runner.profile_activation_peak(max_num_batched_tokens, max_num_seqs)

    def execute(self, sched: SchedulerOutput, grammar: Any = None) -> ModelRunnerOutput:
        """The step goes to every rank without what only sampling reads (outputs so far, prompts
        of requests not scoring them): the other ranks run the forward, not the sampler."""
        self.group.broadcast(RunnerCall("execute", (for_other_ranks(sched),)))
        return self.runner.execute(sched, grammar)

    def close(self) -> None:
        self.group.close()


def for_other_ranks(sched: SchedulerOutput) -> SchedulerOutput:
    """The step as ranks > 0 need it: each sample row without its output so far (penalties and
    grammars are rank 0's), and prompts only where prompt logprobs are scored; a step's message
    then grows with the tokens it computes, not with every scheduled request's whole history."""
    return dataclasses.replace(sched, scheduled=[
        dataclasses.replace(
            e,
            # drafts stay: every rank computes logits at each drafted position (a collective)
            samples=[SampleRow(row.seq_id, row.sample_index, draft_token_ids=row.draft_token_ids) for row in e.samples],
            prompt_token_ids=e.prompt_token_ids if e.sampling_params.prompt_logprobs is not None else [],
        )
        for e in sched.scheduled
    ])


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun for more than one rank
    (its env rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), world


def run_worker_from_env(model_dir: str, dtype: str, tensor_parallel_size: int, device: str = "cpu",
                        quantization: str = "none", activation_dtype: str = "float32") -> None:
    """A rank > 0 started by torchrun (on this node or another): be a worker of rank 0's engine."""
    rank, world = torchrun_rank()
    if world != tensor_parallel_size:
        raise ValueError(f"torchrun started {world} ranks but --tensor-parallel-size is {tensor_parallel_size}")
    serve_rank(rank, world, "env://", WorkerSpec(model_dir, dtype, torch.get_num_threads(), device, quantization,
                                                            activation_dtype))


def start_tensor_parallel(world: int, model_dir: Path, spec: WorkerSpec) -> tuple[CausalLM, ModelConfig, TensorParallelGroup]:
    """(rank 0's shard, its config, the group): the other ranks are spawned here, or were started
    by torchrun (maybe on other machines); every rank loads and shards the same way (load_shard)."""
    from octavo.distributed.layers import check_divisible
    from octavo.models.loader import gguf_source
    from octavo.models.registry import load_model_config

    launched = torchrun_rank()
    if spec.device.startswith("cuda") and torch_rank_count() < world and launched is None:
        raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs here, torch sees {torch_rank_count()}; "
                         "start the ranks with torchrun across machines, or lower it")
    quantized = spec.quantization in ("int8", "int4") or (spec.quantization == "auto" and gguf_source(model_dir) is not None)
    check_divisible(load_model_config(model_dir), world, quantized)
    if launched is not None:  # torchrun started every rank, maybe on several machines
        if launched != (0, world):
            raise ValueError(f"under torchrun the engine is rank 0 of {world}; this is {launched}")
        group = TensorParallelGroup(world, spec, "env://", spawn=False)
    else:
        threads = max(1, torch.get_num_threads() // world)  # the ranks share the cores
        group = TensorParallelGroup(world, dataclasses.replace(spec, threads=threads))
        torch.set_num_threads(threads)
    try:
        model, model_config = load_shard(spec, 0, world)
    except BaseException:
        try:
            group.close()
        except Exception:  # the workers failed the same way and left: the load's error is the one to see
            logger.exception("closing the tensor-parallel group after a failed load")
        raise
    return model, model_config, group


def torch_rank_count() -> int:
    """GPUs torch sees on this node (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
