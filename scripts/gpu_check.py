"""The GPU check: one prepared run on a GPU box (scripts/gpu_check.sh calls it after the GPU tests).

Needs nothing from the network and no checkpoint: Llama-shaped models are built in memory with
seeded random weights (a SmolLM2-135M shape, and a Llama-3.1-8B shape in bf16, ~16 GB). Stages,
each timed and logged on its own (a failing stage is reported and the others still run):

  kernels     every Triton op vs the torch reference on 8B-shaped tensors: max error, and time of
              each (does it pay off on this GPU?)
  oracle      greedy tokens, SmolLM2 shape: float32 Triton vs the reference backend vs transformers
              (token-exact expected); bf16 Triton vs transformers bf16 (sequences equal, first
              divergence positions)
  graphs      CUDA graphs vs eager, token-exact, and the decode step time of each
  decode      8B decode step at batch 1/16/64/256 beside its memory roofline (weights + KV bytes
              read / measured copy bandwidth)
  throughput  8B, the same requests for Octavo, transformers `generate` (static batch 16) and its
              continuous batching (skipped when the time left is too short)

  tests       the GPU tests (compiled Triton kernels, CUDA graphs, memory profiling), without -x

Each stage runs in a child process of its own under the run's deadline (--budget-s): a CUDA fault,
a hang or a kill in one stage ends that stage alone, and the others still run. After every stage
--log-dir holds the whole story so far, in at most 6 files: summary.txt (the table), results.json,
gpu_check.log (this process's log) and logs.tar.gz (each stage's own log and traceback, env.txt);
an outside kill at the time limit leaves the table of the stages done. `--smoke` runs every stage
on tiny shapes on the CPU (reference kernels; no CUDA) so the script itself is tested in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from octavo.engine import LLMEngine  # noqa: E402
from octavo.engine_args import EngineArgs  # noqa: E402
from octavo.llm import LLM  # noqa: E402
from octavo.models.loader import model_from_hf, weight_bytes  # noqa: E402
from octavo.sampling.params import SamplingParams  # noqa: E402
from octavo.tokenizer import synthetic_tokenizer  # noqa: E402

SHAPES = {
    "smol": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, theta=100000.0),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, theta=500000.0),
    "tiny": dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, theta=10000.0),
}
log = logging.getLogger("gpu_check")


class Check:
    """A stage's rows and results, written to `work_dir` as they come (a stage killed midway keeps
    the rows it made); the parent reads them back."""

    def __init__(self, work_dir: Path, stage: str, deadline: float) -> None:
        self.rows: list[tuple[str, str, str, str]] = []
        self.results: dict[str, Any] = {}
        self.deadline = deadline  # time.time() the whole run must end by
        self.rows_file = work_dir / f"{stage}.rows.jsonl"
        self.results_file = work_dir / f"{stage}.results.json"

    def left_s(self) -> float:
        return self.deadline - time.time()

    def row(self, stage: str, what: str, value: str, target: str = "") -> None:
        self.rows.append((stage, what, value, target))
        with open(self.rows_file, "a") as fh:
            fh.write(json.dumps([stage, what, value, target]) + "\n")
        log.info("%-10s %-46s %s %s", stage, what, value, target)

    def save_results(self) -> None:
        self.results_file.write_text(json.dumps(self.results, indent=2, default=str))


def table(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("stage", "measure", "value", "target")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


# ---- models -----------------------------------------------------------------------------------


def hf_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A transformers Llama of `shape` with seeded random weights, built in `dtype` on `device`.

    Built in its dtype, as from_pretrained(dtype=...) does, never built in float32 and cast: a cast
    takes the RoPE `inv_freq` buffer to bf16 too (transformers #25681) and the bf16 rows would
    measure against a degraded reference. The weights are those of the float32 build (same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = dict(SHAPES[shape])
    theta = s.pop("theta")
    cfg = LlamaConfig(**s, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    return model


def engine_for(hf, dtype: torch.dtype, device: str, **kwargs) -> LLMEngine:
    model, model_config = model_from_hf(hf, dtype, device)
    args = EngineArgs(device=device, dtype=str(dtype).removeprefix("torch."), **kwargs)
    return LLMEngine(args.to_config(model_config), model, synthetic_tokenizer(model_config.vocab_size), weight_bytes(model))


def random_prompts(n: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    device = next(hf.parameters()).device
    out = []
    for p in prompts:  # one at a time: no padding, the plainest reference
        ids = torch.tensor([p], device=device)
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def timed(fn: Callable[[], Any], repeats: int, device: str) -> float:
    """Median seconds of fn() over `repeats` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- stages -----------------------------------------------------------------------------------


def step_on(device: str, dtype: torch.dtype, heads: int, kv_heads: int, d: int, lengths: list[tuple[int, int]]):
    """A paged-attention step (tests/kernels/paged_steps.py, block size 16) moved to `device`."""
    from tests.kernels.paged_steps import build_step

    q, k_cache, v_cache, meta, _ = build_step(16, heads, kv_heads, d, lengths)
    for f in ("slot_mapping", "block_tables", "query_starts", "query_lens", "context_lens"):
        setattr(meta, f, getattr(meta, f).to(device))
    return q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta


def stage_kernels(c: Check, device: str, smoke: bool) -> None:
    """Triton vs reference on 8B-shaped tensors (tiny on --smoke): max error and time per op."""
    from octavo.kernels import dispatch, reference

    backend = "triton" if device == "cuda" else "reference"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows, hidden, inter = (64, 4096, 14336) if not smoke else (4, 64, 96)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = torch.ones(hidden, device=device, dtype=dtype)
    gu = torch.randn(rows, 2 * inter, device=device, dtype=dtype)
    ops = {
        "rms_norm": (lambda b: dispatch.rms_norm(x, w, 1e-5, b), lambda: reference.rms_norm(x, w, 1e-5)),
        "add_rms_norm": (lambda b: dispatch.add_rms_norm(x, x, w, 1e-5, b)[0],
                         lambda: reference.add_rms_norm(x, x, w, 1e-5)[0]),
        "silu_and_mul": (lambda b: dispatch.silu_and_mul(gu, b), lambda: reference.silu_and_mul(gu)),
    }
    for name, (fast, ref) in ops.items():
        err = (fast(backend).float() - ref().float()).abs().max().item()
        t_fast, t_ref = timed(lambda: fast(backend), 20, device), timed(ref, 20, device)
        c.row("kernels", f"{name} [{rows}x{hidden}] max err / speedup", f"{err:.2e} / {t_ref / t_fast:.2f}x", "pays off if > 1")
    heads, kv_heads, d = (32, 8, 128) if not smoke else (4, 2, 64)
    cases = {"decode b64 ctx~1k": [(1000 + 7 * i, 1) for i in range(64 if not smoke else 4)],
             "mixed 4 chunks + 60 decodes": [(500, 512)] * (4 if not smoke else 1) + [(900, 1)] * (60 if not smoke else 3)}
    if smoke:
        cases = {k: [(min(p, 40), min(n, 9)) for p, n in v] for k, v in cases.items()}
    for name, lengths in cases.items():
        q, k_cache, v_cache, meta = step_on(device, dtype, heads, kv_heads, d, lengths)
        ref = lambda: reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5)  # noqa: E731
        meta.backend = backend
        fast = lambda: dispatch.paged_attention(q, k_cache, v_cache, meta, d**-0.5)  # noqa: E731
        err = (fast().float() - ref().float()).abs().max().item()
        t_fast, t_ref = timed(fast, 10, device), timed(ref, 10, device)
        c.row("kernels", f"attention {name} max err / speedup", f"{err:.2e} / {t_ref / t_fast:.2f}x", "err < 2e-2 (bf16)")
    if device == "cuda":
        from octavo.kernels.triton import paged_attention as tpa

        q, k_cache, v_cache, meta = step_on(device, dtype, heads, kv_heads, d, [(8191, 1)])
        unified = timed(lambda: tpa.paged_attention(q, k_cache, v_cache, meta, d**-0.5), 10, device)
        split = timed(lambda: tpa.paged_attention_split_kv(q, k_cache, v_cache, meta, d**-0.5, 16), 10, device)
        err = (tpa.paged_attention_split_kv(q, k_cache, v_cache, meta, d**-0.5, 16).float()
               - reference.paged_attention(q, k_cache, v_cache, meta, d**-0.5).float()).abs().max().item()
        c.row("kernels", "split-KV (16) vs unified, batch 1 ctx 8192", f"{unified / split:.2f}x, err {err:.2e}", "> 1")


def stage_oracle(c: Check, device: str, smoke: bool) -> None:
    shape = "tiny" if smoke else "smol"
    vocab = SHAPES[shape]["vocab_size"]
    prompts = random_prompts(4 if smoke else 16, vocab, 5, 40 if smoke else 200, seed=1)
    max_tokens = 8 if smoke else 32
    kv = dict(num_kv_blocks=512 if smoke else 4096)
    hf32 = hf_model(shape, torch.float32, device)
    expected = hf_greedy(hf32, prompts, max_tokens)
    backends = ["reference", "triton"] if device == "cuda" else ["reference"]
    outs = {b: greedy(engine_for(hf32, torch.float32, device, attention_backend=b, **kv), prompts, max_tokens) for b in backends}
    for b, got in outs.items():
        exact = sum(g == e for g, e in zip(got, expected))
        c.row("oracle", f"float32 {b} == transformers (sequences)", f"{exact}/{len(prompts)}", "all")
    if "triton" in outs:
        exact = sum(a == b for a, b in zip(outs["triton"], outs["reference"]))
        c.row("oracle", "float32 triton == reference backend", f"{exact}/{len(prompts)}", "all (token-exact)")
    del hf32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf16 = hf_model(shape, dtype, device)
    expected = hf_greedy(hf16, prompts, max_tokens)
    got = greedy(engine_for(hf16, dtype, device, **kv), prompts, max_tokens)
    div = [first_divergence(g, e) for g, e in zip(got, expected)]
    same = sum(d is None for d in div)
    firsts = sorted(d for d in div if d is not None)
    agree = sum(x == y for g, e in zip(got, expected) for x, y in zip(g, e)) / sum(len(e) for e in expected)
    c.row("oracle", f"{str(dtype)[6:]} vs transformers: equal sequences", f"{same}/{len(prompts)}", "reported")
    c.row("oracle", f"{str(dtype)[6:]} top-1 agreement (positions)", f"{agree:.1%}", "reported")
    c.row("oracle", f"{str(dtype)[6:]} first divergence positions", str(firsts[:8]) if firsts else "none", "reported")
    c.results["oracle_bf16_first_divergence"] = div


def decode_step_time(engine: LLMEngine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median seconds of an engine step once `batch` requests of `context` prompt tokens all decode."""
    params = SamplingParams(temperature=0, max_tokens=context + steps + 64, ignore_eos=True)
    ids = [f"d{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, random_prompts(batch, vocab, context, context, seed=batch)):
        engine.add_request(rid, p, params)
    for _ in range(10_000):  # until a step schedules one token per request: all prompts are in
        engine.step()
        stats = engine.scheduler.stats()
        if stats.num_waiting == 0 and stats.num_scheduled_tokens == stats.num_scheduled_requests == batch:
            break
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns after the sampled tokens reach the host: synchronised
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    return statistics.median(times)


def stage_graphs(c: Check, device: str, smoke: bool) -> None:
    if device != "cuda":
        c.row("graphs", "CUDA graphs", "skipped (no CUDA)", "")
        return
    shape = "smol"
    vocab = SHAPES[shape]["vocab_size"]
    prompts = random_prompts(24, vocab, 5, 300, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        hf = hf_model(shape, dtype, device)
        eager = engine_for(hf, dtype, device, num_kv_blocks=8192, max_num_seqs=32)
        graphed = engine_for(hf, dtype, device, num_kv_blocks=8192, max_num_seqs=32, enforce_eager=False)
        a, b = greedy(eager, prompts, 48), greedy(graphed, prompts, 48)
        name = str(dtype)[6:]
        c.row("graphs", f"{name} graphs == eager (sequences)", f"{sum(x == y for x, y in zip(a, b))}/{len(prompts)}", "all")
        t_e = decode_step_time(eager, 16, 256, 20, vocab)
        t_g = decode_step_time(graphed, 16, 256, 20, vocab)
        c.row("graphs", f"{name} decode step b16, eager / graphs", f"{t_e * 1e3:.2f} / {t_g * 1e3:.2f} ms", "graphs faster")
        c.results[f"graphs_{name}_replays"] = graphed.runner.graphs.num_replays
        del eager, graphed, hf


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy (read + write counted)."""
    n = (2 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), 10, device)


def stage_decode_and_throughput(c: Check, device: str, smoke: bool, args: argparse.Namespace) -> None:
    shape = "tiny" if smoke else "llama8b"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    vocab = SHAPES[shape]["vocab_size"]
    hf = hf_model(shape, dtype, device)
    hf_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    kwargs = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    if device == "cuda":  # the transformers copy of the weights lives in the same process
        total = torch.cuda.mem_get_info()[1]
        kwargs["gpu_memory_utilization"] = round(0.88 - hf_bytes / total, 3)
    else:
        kwargs.update(num_kv_blocks=2048, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    engine = engine_for(hf, dtype, device, **kwargs)
    c.row("decode", "KV cache (profiled)", engine.kv_sizing.describe().removeprefix("KV cache: ")[:60], "")
    bandwidth = copy_bandwidth(device)
    c.row("decode", "measured copy bandwidth", f"{bandwidth / 1e9:.0f} GB/s", "")
    weights = weight_bytes(engine.runner.model)
    kv_per_token = engine.config.model_config.kv_bytes_per_token(engine.config.cache.cache_dtype)
    context = 512 if not smoke else 32
    for batch in ((1, 16, 64, 256) if not smoke else (1, 4)):
        step = decode_step_time(engine, batch, context, 20 if not smoke else 3, vocab)
        roofline = (weights + batch * (context + 10) * kv_per_token) / bandwidth
        c.row("decode", f"{shape} step batch {batch} (ctx {context}): time / roofline",
              f"{step * 1e3:.2f} / {roofline * 1e3:.2f} ms = {step / roofline:.2f}x",
              "<= 2x at batch 64" if batch == 64 else "")
        c.results[f"decode_b{batch}"] = {"step_s": step, "roofline_s": roofline}

    from octavo.bench.throughput import run_hf, run_hf_cb, run_octavo
    from octavo.simulator.workload import SimRequest

    n = args.num_requests if not smoke else 8
    prompts = random_prompts(n, vocab, *((256, 768) if not smoke else (5, 30)), seed=3)
    out_len = args.output_len if not smoke else 8
    workload = [SimRequest(0.0, tuple(p), out_len) for p in prompts]
    res = {"octavo": run_octavo(workload, {}, progress=False, engine=engine)}
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    res["hf"] = run_hf(workload, None, batch_size=16, progress=False, model=hf)
    if smoke:  # its manager's start-up alone takes ~30 s on two cores; the bench tests cover it
        c.row("throughput", "hf-cb", "skipped (--smoke)", "")
    elif c.left_s() > 2.5 * res["hf"].elapsed_s:
        try:
            res["hf-cb"] = run_hf_cb(workload, None, progress=False, model=hf)
        except Exception as exc:  # transformers' manager has its own limits; report, do not stop
            c.row("throughput", "hf-cb", f"failed: {type(exc).__name__}: {str(exc)[:80]}", "")
    else:
        c.row("throughput", "hf-cb", f"skipped: {c.left_s():.0f} s left", "")
    for name, r in res.items():
        c.row("throughput", f"{name} output tok/s ({n} req, {out_len} out)", f"{r.output_tok_s:.0f} ({r.elapsed_s:.1f} s)", "")
    c.row("throughput", "octavo / hf generate (static batch 16)",
          f"{res['octavo'].output_tok_s / res['hf'].output_tok_s:.2f}x", ">= 10x")
    if "hf-cb" in res:
        c.row("throughput", "octavo / hf continuous batching", f"{res['octavo'].output_tok_s / res['hf-cb'].output_tok_s:.2f}x", "")
    c.results["throughput"] = {k: v.to_dict() for k, v in res.items()}


def stage_tests(c: Check, device: str, smoke: bool) -> None:
    """The GPU tests, all of them (no -x), in pytest's own process; their count as a row."""
    files = ["tests/kernels/test_triton_kernels.py", "tests/engine/test_triton_backend.py", "tests/engine/test_cuda_path.py"]
    if smoke:  # the script's plumbing, not the GPU: one quick file
        files = ["tests/test_import_layers.py"]
    env = {k: v for k, v in os.environ.items() if not (device == "cuda" and k == "TRITON_INTERPRET")}
    log_file = c.rows_file.parent / "pytest.log"
    with open(log_file, "w") as fh:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=max(10.0, c.left_s() - 5))
    last = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
    c.row("tests", f"pytest {len(files)} files (exit {proc.returncode})", last[0][:70], "all passed")


# The most seconds each stage may take on a GPU, within the run's deadline (a hang loses one stage).
STAGE_CAP_S = {"kernels": 90, "oracle": 120, "graphs": 120, "decode": 240, "tests": 240}

STAGES: dict[str, Callable[[Check, str, bool, argparse.Namespace], None]] = {
    "kernels": lambda c, device, smoke, args: stage_kernels(c, device, smoke),
    "oracle": lambda c, device, smoke, args: stage_oracle(c, device, smoke),
    "graphs": lambda c, device, smoke, args: stage_graphs(c, device, smoke),
    "decode": stage_decode_and_throughput,
    "tests": lambda c, device, smoke, args: stage_tests(c, device, smoke),
}


def run_stage_here(args: argparse.Namespace) -> int:
    """A child: run one stage, its rows and results written to the work folder as they come."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    c = Check(args.work_dir, args.run_stage, args.deadline)
    if args.fault == args.run_stage:  # the test of fault containment: die as a CUDA fault does
        c.row(args.run_stage, "before the fault", "ok")
        os.abort()
    try:
        STAGES[args.run_stage](c, device, args.smoke, args)
    finally:
        c.save_results()
    return 0


class Run:
    """The parent: runs each stage in a child under the deadline; after each, rewrites the table,
    the results and the log tarball, so that what is in --log-dir is always whole."""

    def __init__(self, log_dir: Path, work_dir: Path, budget_s: float) -> None:
        self.log_dir, self.work_dir = log_dir, work_dir
        self.deadline = time.time() + budget_s
        self.rows: list[tuple[str, str, str, str]] = []
        self.results: dict[str, Any] = {"stage_seconds": {}, "stage_exit": {}}

    def stage(self, name: str, argv: list[str]) -> None:
        left = min(self.deadline - time.time(), STAGE_CAP_S[name])
        log.info("=== %s (%.0f s given)", name, left)
        start = time.monotonic()
        if left < 5:
            self.rows.append((name, "SKIPPED", f"no time left ({left:.0f} s)", ""))
            self.write()
            return
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--run-stage", name,
               "--work-dir", str(self.work_dir), "--deadline", str(time.time() + left)]
        with open(self.work_dir / f"{name}.log", "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code: int | str = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = "timeout"
        self.collect(name, code)
        self.results["stage_seconds"][name] = round(time.monotonic() - start, 1)
        self.write()

    def collect(self, name: str, code: int | str) -> None:
        rows_file = self.work_dir / f"{name}.rows.jsonl"
        if rows_file.is_file():
            self.rows += [tuple(json.loads(line)) for line in rows_file.read_text().splitlines() if line.strip()]
        results_file = self.work_dir / f"{name}.results.json"
        if results_file.is_file():
            self.results.update(json.loads(results_file.read_text()))
        self.results["stage_exit"][name] = code
        for row in self.rows[-8:]:
            log.info("%-10s %-46s %s %s", *row)
        if code != 0:
            tail = [ln for ln in (self.work_dir / f"{name}.log").read_text(errors="replace").splitlines() if ln.strip()]
            why = "ran past the deadline" if code == "timeout" else f"exit {code}"
            self.rows.append((name, "FAILED", f"{why}: {(tail[-1] if tail else '')[:100]}", ""))
            log.error("stage %s failed (%s); its log (in logs.tar.gz) ends:\n%s", name, why, "\n".join(tail[-15:]))

    def write(self) -> None:
        """The table, the results and the tarball of every stage's log, each replaced whole."""
        text = table(self.rows) + "\n"
        for file_name, content in (("summary.txt", text), ("results.json", json.dumps(self.results, indent=2, default=str))):
            tmp = self.log_dir / f".{file_name}.tmp"
            tmp.write_text(content)
            os.replace(tmp, self.log_dir / file_name)
        tmp = self.log_dir / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work_dir, arcname="logs")
        os.replace(tmp, self.log_dir / "logs.tar.gz")

    @property
    def failed(self) -> bool:
        return any(r[1] in ("FAILED", "SKIPPED") for r in self.rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-dir", type=Path, default=Path("gpu_check_logs"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: tests the script, measures nothing")
    ap.add_argument("--budget-s", type=float, default=420.0, help="seconds the whole run may take (stages stop at it)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stages", default="kernels,oracle,graphs,decode,tests")
    ap.add_argument("--fault", default=None, help=argparse.SUPPRESS)  # a stage that aborts (tests)
    ap.add_argument("--run-stage", default=None, help=argparse.SUPPRESS)  # a child runs this stage
    ap.add_argument("--work-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_stage is not None:
        return run_stage_here(args)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(args.log_dir / "gpu_check.log")])
    if not args.smoke and not torch.cuda.is_available():
        log.error("no CUDA device: run with --smoke to test the script on the CPU")
        return 2
    unknown = [s for s in args.stages.split(",") if s not in STAGES]
    if unknown:
        log.error("unknown stages %s (known: %s)", unknown, ", ".join(STAGES))
        return 2
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_check-"))  # outside --log-dir: one tarball goes there
    env_file = args.log_dir / "env.txt"  # gpu_check.sh's facts about the machine travel in the tarball
    if env_file.is_file():
        os.replace(env_file, work_dir / "env.txt")
    run = Run(args.log_dir, work_dir, args.budget_s)
    run.rows.append(("env", "torch / triton / transformers", _versions(), ""))
    if torch.cuda.is_available() and not args.smoke:
        props = torch.cuda.get_device_properties(0)
        run.rows.append(("env", "GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs", ""))
    run.write()
    child_argv = list(argv if argv is not None else sys.argv[1:])
    for name in args.stages.split(","):
        run.stage(name, child_argv)
    print("\n" + table(run.rows), flush=True)
    return 1 if run.failed else 0


def _versions() -> str:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return f"{torch.__version__} / {triton_version} / {transformers.__version__}"


if __name__ == "__main__":
    sys.exit(main())
