"""Offline throughput, side by side: Octavo vs transformers' static `generate` and its continuous batching.

Every backend gets the same requests and weights, greedy, with forced output lengths (EOS ignored),
and each backend's output token count is checked against what was asked.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from octavo.simulator.workload import SimRequest


@dataclass(slots=True)
class ThroughputResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    peak_memory_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(requests_per_s=self.requests_per_s, output_tok_s=self.output_tok_s, total_tok_s=self.total_tok_s)
        return d


class OutputCountError(RuntimeError):
    pass


def _reset_peak_rss() -> None:
    """Start a fresh high-water mark of resident memory (Linux: clear_refs 5 resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _check(backend: str, asked: list[int], got: list[int]) -> None:
    bad = [(i, a, g) for i, (a, g) in enumerate(zip(asked, got)) if a != g]
    if bad or len(asked) != len(got):
        raise OutputCountError(f"{backend}: output token counts differ from those asked, first (request, asked, got): {bad[:3]}")


def run_octavo(
    workload: list[SimRequest], engine_args: dict[str, Any], progress: bool = True, engine: Any = None,
    loras: list[Any] | None = None,
) -> ThroughputResult:
    """Octavo on the workload; `engine` (an LLMEngine already built, e.g. over an in-memory model)
    replaces building one from `engine_args`; `loras[i]` is request i's LoRARequest (or None)."""
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.sampling.params import RequestOutputKind, SamplingParams
    from octavo.simulator.simulator import used_slots

    engine = engine or LLMEngine.from_args(EngineArgs(**engine_args))
    _reset_peak_rss()
    start = time.perf_counter()
    for i, w in enumerate(workload):
        # final outputs only, as LLM.generate asks: nothing is copied out per step
        params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(str(i), list(w.prompt_token_ids), params, arrival_time=time.time(),
                           lora_request=loras[i] if loras else None)
    outputs: dict[str, Any] = {}
    batch_sizes, kv_util = [], []
    sched = engine.scheduler
    with tqdm(total=len(workload), desc="octavo", unit="req", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
            stats = sched.stats()
            batch_sizes.append(stats.num_scheduled_requests)
            allocated = (sched.kv_cache.num_blocks - sched.kv_cache.num_free_blocks) * sched.kv_cache.block_size
            if allocated:
                kv_util.append(used_slots(sched) / allocated)
            for o in finished:
                outputs[o.request_id] = o
            bar.update(len(finished))
    elapsed = time.perf_counter() - start
    got = [len(outputs[str(i)].outputs[0].token_ids) for i in range(len(workload))]
    asked = [w.output_len for w in workload]
    _check("octavo", asked, got)
    stats = engine.get_stats()
    s = stats.scheduler
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs.values() if o.metrics.first_token_time]
    return ThroughputResult(
        "octavo", len(workload), elapsed, sum(len(w.prompt_token_ids) for w in workload), sum(got), _peak_rss(),
        extra={
            "preemptions": s.preemption.num_preemptions,
            "prefix_cache_hit_rate": s.prefix.num_hits_tokens / s.prefix.num_queries_tokens if s.prefix.num_queries_tokens else 0.0,
            "prompt_tokens_computed": stats.num_prompt_tokens_total,
            "mean_batch_size": sum(batch_sizes) / len(batch_sizes),
            "mean_kv_utilisation": sum(kv_util) / len(kv_util) if kv_util else 0.0,
            "mean_ttft_s": sum(ttft) / len(ttft),
            "steps": stats.num_steps,
            "recomputed_tokens": s.preemption.num_recomputed_tokens,
            "repreemptions": s.preemption.num_repreemptions,
            "most_preemptions_of_one": max((o.metrics.num_preemptions for o in outputs.values()), default=0),
            "resumed": s.preemption.num_resumed,
            "prompt_tokens_reused": s.prefix.num_hits_tokens,
            "tier_blocks_stored": s.tier.num_stored if s.tier else 0,
            "tier_blocks_loaded": s.tier.num_loaded if s.tier else 0,
        },
    )


def _load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from octavo.models.loader import dense_weights

    return AutoModelForCausalLM.from_pretrained(str(dense_weights(model_dir)), dtype=torch.float32).eval()


def run_hf(
    workload: list[SimRequest], model_dir: Path | None, batch_size: int = 16, progress: bool = True, model: Any = None
) -> ThroughputResult:
    """transformers `generate` in static batches of `batch_size`, left-padded, in arrival order. A batch
    decodes until its longest request is done (that is static batching); each request keeps its own
    forced length. `model`: a loaded transformers model instead of `model_dir`'s (on its device)."""
    import torch

    model = model if model is not None else _load_hf(model_dir)
    device = next(model.parameters()).device
    pad = 0
    _reset_peak_rss()
    start = time.perf_counter()
    got: list[int] = []
    with torch.inference_mode(), tqdm(total=len(workload), desc="hf", unit="req", disable=not progress) as bar:
        for b in range(0, len(workload), batch_size):
            batch = workload[b : b + batch_size]
            width = max(len(w.prompt_token_ids) for w in batch)
            ids = torch.tensor([[pad] * (width - len(w.prompt_token_ids)) + list(w.prompt_token_ids) for w in batch], device=device)
            mask = torch.tensor([[0] * (width - len(w.prompt_token_ids)) + [1] * len(w.prompt_token_ids) for w in batch], device=device)
            longest = max(w.output_len for w in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad)
            produced = out.shape[1] - width
            got.extend(min(w.output_len, produced) for w in batch)
            bar.update(len(batch))
    elapsed = time.perf_counter() - start
    asked = [w.output_len for w in workload]
    _check("hf", asked, got)
    return ThroughputResult("hf", len(workload), elapsed, sum(len(w.prompt_token_ids) for w in workload), sum(got),
                            _peak_rss(), extra={"batch_size": batch_size})


def run_hf_cb(workload: list[SimRequest], model_dir: Path | None, progress: bool = True, model: Any = None) -> ThroughputResult:
    """transformers' own continuous batching (the manager behind `generate_batch`), per-request lengths."""
    from transformers import GenerationConfig

    model = model if model is not None else _load_hf(model_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(w.output_len for w in workload), eos_token_id=-1)
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager, \
            tqdm(total=len(workload), desc="hf-cb", unit="req", disable=not progress) as bar:
        _reset_peak_rss()  # the manager's warm-up (entering the context) is not timed
        start = time.perf_counter()
        for i, w in enumerate(workload):
            manager.add_request(list(w.prompt_token_ids), request_id=str(i), max_new_tokens=w.output_len, eos_token_id=-1)
        while len(results) < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
    elapsed = time.perf_counter() - start
    got = [len(results[str(i)].generated_tokens) for i in range(len(workload))]
    asked = [w.output_len for w in workload]
    _check("hf-cb", asked, got)
    return ThroughputResult("hf-cb", len(workload), elapsed, sum(len(w.prompt_token_ids) for w in workload), sum(got),
                            _peak_rss())


def format_results(results: list[ThroughputResult]) -> str:
    lines = [f"{'backend':8} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>12} {'peak RSS':>10} {'elapsed s':>10}"]
    for r in results:
        lines.append(f"{r.backend:8} {r.requests_per_s:7.2f} {r.output_tok_s:10.1f} {r.total_tok_s:12.1f} "
                     f"{r.peak_memory_bytes / 2**30:8.2f}Gi {r.elapsed_s:10.1f}")
    for r in results:
        if r.extra and r.backend == "octavo":
            e = r.extra
            lines.append(
                f"octavo: preemptions {e['preemptions']}, prefix-cache hit rate {e['prefix_cache_hit_rate']:.1%}, "
                f"prompt tokens computed {e['prompt_tokens_computed']}, mean batch {e['mean_batch_size']:.1f}, "
                f"mean KV utilisation {e['mean_kv_utilisation']:.1%}, mean TTFT {e['mean_ttft_s']:.2f} s, steps {e['steps']}, "
                f"tokens recomputed after preemption {e['recomputed_tokens']}, re-preemptions {e['repreemptions']} "
                f"(most of one request: {e['most_preemptions_of_one']} preemptions)"
                + (f", KV tier blocks stored {e['tier_blocks_stored']} / loaded {e['tier_blocks_loaded']}"
                   if e["tier_blocks_stored"] else "")
            )
    base = next((r for r in results if r.backend == "octavo"), None)
    if base is not None:
        for r in results:
            if r is not base:
                lines.append(f"octavo / {r.backend}: {base.output_tok_s / r.output_tok_s:.2f}x output tokens/s")
    return "\n".join(lines)
