"""Command line: parses flags and calls the library. `octavo generate` is today's main job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from octavo.config import DEFAULT_MAX_WAIT_STEPS
from octavo.sampling.params import MAX_LOGPROBS
from octavo.server.parsers.reasoning import REASONING_PARSERS
from octavo.server.parsers.tool_calls import TOOL_CALL_PARSERS

DEFAULT_CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in a language model, briefly.",
]


_FLAG_TYPES = {"int": int, "float": float, "str": str}


def add_engine_flags(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """One flag per EngineArgs field (named as vLLM users know them), built from the dataclass so
    that a field can never lack its flag. `model` is positional for generate and serve."""
    import dataclasses

    from octavo.engine_args import EngineArgs

    for f in dataclasses.fields(EngineArgs):
        meta, flag = f.metadata, "--" + f.name.replace("_", "-")
        kwargs: dict = {"default": f.default, "help": meta.get("help")}
        base = str(f.type).replace(" | None", "")
        if f.name == "model" and model_positional:
            parser.add_argument("model", nargs="?", **kwargs)
            continue
        if base == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("nargs"):
            kwargs.update(nargs="*", type=str)
        else:
            kwargs["type"] = parse_bytes if meta.get("bytes") else _FLAG_TYPES[base]
            if "choices" in meta:
                kwargs["choices"] = list(meta["choices"])
        parser.add_argument(flag, dest=f.name, **kwargs)


def check_model_file(model: str | None) -> None:
    """A .gguf model's header and shapes checked before anything heavy is imported or allocated:
    a malformed file is refused in milliseconds with one line (GGUFFormatError, a ValueError); a
    name that is neither a path nor a packaged model, likewise (FileNotFoundError)."""
    from octavo.models.packaged import check_model_argument

    check_model_argument(model)
    if model is None or not str(model).endswith(".gguf"):
        return
    from pathlib import Path

    from octavo.models.gguf_arch import check_file

    from octavo.models.converted import converted_dir

    path = Path(model).expanduser()
    if path.is_file() and converted_dir(path) is None:  # (converted: checked then, same content)
        check_file(path)


def engine_kwargs(args: argparse.Namespace) -> dict:
    import dataclasses

    from octavo.engine_args import EngineArgs

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}


def cmd_generate(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.llm import LLM
    from octavo.sampling.params import SamplingParams

    kwargs = engine_kwargs(args)
    start = time.perf_counter()
    llm = LLM.from_engine(LLMEngine.from_args(EngineArgs(**kwargs)))
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    chats = args.prompt or DEFAULT_CHATS
    start = time.perf_counter()
    try:
        outputs = llm.chat([[{"role": "user", "content": c}] for c in chats], params, use_tqdm=not args.json)
    finally:
        llm.engine.close()  # tensor-parallel workers stop (no-op otherwise)
    gen_s = time.perf_counter() - start
    stats = llm.engine.get_stats()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if args.json:
        json.dump(
            {
                "answers": [{"prompt": c, "text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason} for c, o in zip(chats, outputs)],
                "load_s": load_s, "generate_s": gen_s, "output_tokens": num_out,
            },
            sys.stdout, indent=2,
        )
        print()
        return 0
    for chat, out in zip(chats, outputs):
        print(f"\n>>> {chat}\n{out.outputs[0].text.strip()}\n    [{len(out.outputs[0].token_ids)} tokens, finish: {out.outputs[0].finish_reason}]")
    s = stats.scheduler
    print(
        f"\n{llm.engine.kv_sizing.describe()}\n"
        f"load {load_s:.1f} s; generate {gen_s:.1f} s for {len(chats)} requests, {num_out} output tokens "
        f"({num_out / gen_s:.1f} tok/s); steps {stats.num_steps}; prompt tokens computed {stats.num_prompt_tokens_total}; "
        f"prefix cache hits {s.prefix.num_hits_tokens}/{s.prefix.num_queries_tokens} tokens; preemptions {s.preemption.num_preemptions}"
    )
    return 0


def _kv_events_routing(args: argparse.Namespace):
    """(index, body -> block hashes, listener) for --policy kv-events; ValueError naming what is missing."""
    from octavo.models.loader import resolve_model
    from octavo.router.app import prompt_token_ids
    from octavo.router.kv_index import KVBlockIndex, PromptHasher
    from octavo.router.kv_listener import EventSource, KVEventListener
    from octavo.tokenizer import load_tokenizer

    if len(args.kv_events_endpoint) != len(args.worker):
        raise ValueError(f"--policy kv-events needs one --kv-events-endpoint per --worker ({len(args.worker)}), "
                         f"got {len(args.kv_events_endpoint)}")
    sources = []
    for url, spec in zip(args.worker, args.kv_events_endpoint):
        pub, _, replay = spec.partition(",")
        sources.append(EventSource(url.rstrip("/"), pub, replay or None))
    tokenizer = load_tokenizer(resolve_model(args.model))
    hasher = PromptHasher(args.block_size)
    index = KVBlockIndex(hasher)
    return index, lambda body: hasher.hashes(prompt_token_ids(body, tokenizer)), KVEventListener(
        index, sources, args.kv_events_topic)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from octavo.router.app import build_router_app
    from octavo.router.policy import Router
    from octavo.server.connections import default_max_connections, protocol_factory

    index = prompt_blocks = listener = None
    if args.policy == "kv-events":
        index, prompt_blocks, listener = _kv_events_routing(args)
    elif args.kv_events_endpoint:
        print("error: --kv-events-endpoint is for --policy kv-events", file=sys.stderr)
        return 2
    router = Router(args.worker, args.policy, args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                    kv_index=index, sent_ttl_s=args.kv_events_sent_ttl)
    logging.getLogger("octavo.router").info("routing %s over %s", args.policy, ", ".join(args.worker))
    app = build_router_app(router, args.health_interval, args.request_timeout, args.max_connections_per_replica,
                           max_request_bytes=args.max_request_bytes, prompt_blocks=prompt_blocks, listener=listener)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=False,
                http=protocol_factory(args.header_timeout, args.max_connections or default_max_connections()))
    return 0


def server_limits(args: argparse.Namespace, limits_cls: type, log: logging.Logger) -> Any:
    """`octavo serve`'s ServerLimits from its flags."""
    if args.max_logprobs < 0 or args.max_logprobs > MAX_LOGPROBS:  # vLLM's -1 / the vocabulary size: "no limit"
        log.warning("--max-logprobs %d: Octavo returns at most %d logprobs; the limit is %d",
                    args.max_logprobs, MAX_LOGPROBS, MAX_LOGPROBS)
        args.max_logprobs = MAX_LOGPROBS
    return limits_cls(
        max_request_bytes=args.max_request_bytes,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_debug_endpoints=args.enable_debug_endpoints,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        runner="pooling" if args.task == "embed" else ("generate" if args.task == "generate" else args.runner),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        enable_force_include_usage=args.enable_force_include_usage,
        max_logprobs=args.max_logprobs,
        enable_request_id_headers=args.enable_request_id_headers,
        root_path=args.root_path,
        generation_defaults=tuple(sorted((args.override_generation_config or {}).items())),
        pooling_type=args.pooling_type,
        matryoshka=args.matryoshka,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        chat_template_timeout_s=args.chat_template_timeout,
        header_timeout_s=args.header_timeout,
        dashboard_interval_s=args.dashboard_interval,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    _check_serve_flags(args)
    listening = bind_port(args.host, args.port)  # a busy port is refused before anything heavy is imported
    import uvicorn

    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.metrics import EngineMetrics
    from octavo.models.loader import DEFAULT_MODEL_NAME
    from octavo.server.app import OpenAIServer, ServerLimits, build_app
    from octavo.server.async_engine import AsyncEngine
    from octavo.server.connections import default_max_connections, protocol_factory

    log = logging.getLogger("octavo")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)", file=sys.stderr)
        return 2
    engine_args = EngineArgs(**engine_kwargs(args))
    names = args.served_model_name or [DEFAULT_MODEL_NAME if args.model is None else args.model]
    name = names[0]
    limits = server_limits(args, ServerLimits, log)
    died: list[BaseException] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            if not self.should_exit:
                log.info("shutdown requested (signal %d): %d requests in flight get up to %.0f s to finish",
                         sig, async_engine.num_in_flight, args.shutdown_timeout)
            super().handle_exit(sig, frame)

    def on_dead(exc: BaseException) -> None:
        died.append(exc)
        if args.keep_alive_on_engine_death:
            log.error("engine died; staying up (--keep-alive-on-engine-death): /health answers 503")
            return
        log.error("engine died; shutting the server down (exit status 1) so a supervisor can restart it")
        http_server.should_exit = True

    # The engine is built on its own thread, which then runs every step (see AsyncEngine).
    async_engine = AsyncEngine(lambda: LLMEngine.from_args(engine_args), EngineMetrics(name, args.metrics_prefix), args.log_interval,
                               args.max_waiting_requests, on_dead)
    _start_or_exit_on_signal(async_engine, log)
    server = OpenAIServer(async_engine, name, args.api_key, limits, aliases=names[1:])
    config = uvicorn.Config(
        build_app(server), host=args.host, port=args.port, log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.access_log,
        http=protocol_factory(args.header_timeout, args.max_connections or default_max_connections()),
    )
    http_server = Server(config)
    log.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    # uvicorn handles SIGINT/SIGTERM (stop accepting, let in-flight requests finish, shut the engine
    # down), then re-raises the signal to the handlers it found. Make those no-ops so a requested
    # shutdown ends with exit status 0 rather than death by signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    http_server.run(sockets=[listening])
    if died:
        log.error("server stopped after the engine failed: %r", died[0])
        return 1
    log.info("server stopped")
    return 0


def bind_port(host: str, port: int) -> Any:
    """The server's listening socket, bound now (ValueError naming the address when it is taken or
    cannot be had), so a busy port costs no model load."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server there? "
                         "pick a free port with --port)") from None
    sock.set_inheritable(True)
    return sock


def _check_serve_flags(args: argparse.Namespace) -> None:
    """The server's own numbers, each in its range (ServerLimits checks the ones it holds)."""
    import math

    checks = [("--port", args.port, 0, 65535), ("--max-waiting-requests", args.max_waiting_requests, 1, 1 << 24),
              ("--log-interval", args.log_interval, 0.01, 86400.0), ("--shutdown-timeout", args.shutdown_timeout, 0.0, 86400.0)]
    if args.max_connections is not None:
        checks.append(("--max-connections", args.max_connections, 1, 1 << 24))
    for flag, value, low, high in checks:
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


def _start_or_exit_on_signal(async_engine, log: logging.Logger) -> None:
    """Build the engine (its first start converts the model and compiles the kernels: minutes).
    If SIGINT or SIGTERM comes first, the process exits (status 0) at once: os._exit, because the
    engine thread is still inside that work (a daemon thread in torch's C++ at interpreter exit
    aborts the process); the kernel compile, a child process, dies with it (PR_SET_PDEATHSIG),
    and what the work left half-done is temporary files the next start removes (octavo/cache.py)."""

    def stop(signum: int, frame) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        async_engine.start()
    except KeyboardInterrupt:
        log.info("stopped while starting")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '24GB', '1.5e9', '512MiB' -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 80GiB, 24GB, 512MiB, 1e9)")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 80GiB, 24GB, 512MiB, 1e9)") from None
    if not value < 2**60:
        raise argparse.ArgumentTypeError(f"not a size this machine could hold: {text!r}")
    return int(value)


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from octavo.planner import format_plan, make_plan, read_fields

    gguf = None  # a GGUF's weights are read from its tensors, as the engine will hold them
    if args.config is None:
        from octavo.models.loader import DEFAULT_MODEL_NAME, default_gguf_path, resolve_model

        path, name, gguf = resolve_model(None) / "config.json", DEFAULT_MODEL_NAME, default_gguf_path()
    else:
        path, name = Path(args.config), args.config
        if not path.exists() or path.suffix == ".gguf":  # a packaged model's name or a GGUF file
            from octavo.models.loader import PACKAGED_MODELS, packaged_gguf, resolve_model

            gguf = path if path.suffix == ".gguf" else packaged_gguf(args.config) if args.config in PACKAGED_MODELS else None
            path = resolve_model(args.config)
        path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    hf = json.loads(path.read_text())
    kv_dtype, kv_why = (args.kv_dtype, "--kv-cache-dtype") if args.kv_dtype else _serving_kv_dtype(hf, quantized=gguf is not None)
    weight_bytes, weight_source = args.weight_bytes, "--weight-bytes"
    if weight_bytes is None and gguf is not None and args.weight_dtype is None:
        from octavo.models.gguf_file import read_header
        from octavo.models.loader import held_weight_bytes

        weight_bytes, weight_source = held_weight_bytes(read_header(gguf)), f"{Path(gguf).name}'s tensors as the engine holds them"
    device_memory, kv_memory, memory_source = _serving_memory(args.device_memory)
    plan = make_plan(
        read_fields(hf), device_memory=device_memory, memory_fraction=args.memory_fraction,
        kv_memory=kv_memory, memory_source=memory_source,
        kv_dtype=kv_dtype, weight_bytes=weight_bytes, weight_dtype=args.weight_dtype,
        block_size=args.block_size, typical_len=args.typical_len, max_len=args.max_len,
        kv_dtype_source=kv_why, weight_source=weight_source if weight_bytes is not None else "",
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan, name))
    return 0


def _serving_memory(device_memory: int | None) -> tuple[int, int | None, str]:
    """(device memory, the KV cache's memory or None to take device memory x fraction - weights,
    where it came from) for `octavo plan`: --device-memory when given; else what `octavo serve`
    gives the KV cache on this machine (a CPU: min(4 GiB, 25% of RAM); a GPU: its memory)."""
    if device_memory is not None:
        return device_memory, None, ""
    from octavo.engine_args import resolve_device
    from octavo.memory import CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_SHARE, total_device_memory

    device = resolve_device("auto")
    total = total_device_memory(device)
    if device.startswith("cuda"):
        return total, None, ""
    budget = min(CPU_DEFAULT_KV_BYTES, int(CPU_DEFAULT_MAX_SHARE * total))
    return total, budget, (f"what serve gives it on this CPU: min({CPU_DEFAULT_KV_BYTES / 2**30:g} GiB, "
                           f"{CPU_DEFAULT_MAX_SHARE:.0%} of {total / 2**30:.1f} GiB of RAM); --kv-cache-memory changes it")


def _serving_kv_dtype(hf_config: dict, quantized: bool) -> tuple[str, str]:
    """(the KV dtype `octavo serve` would use for this model on this machine, why): its --dtype
    auto rule without loading the weights."""
    from octavo.engine_args import resolve_device
    from octavo.kernels.kv_dtype_rule import auto_kv_cache_dtype
    from octavo.models.loader import dtype_rule

    device = resolve_device("auto")
    dtype, why = dtype_rule(quantized, device, hf_config.get("torch_dtype") or hf_config.get("dtype"))
    kv_dtype, kv_why = auto_kv_cache_dtype(dtype, device)
    return kv_dtype, f"what serve uses here: --kv-cache-dtype {kv_why}; the dtype {dtype}: {why}"


def cmd_simulate(args: argparse.Namespace) -> int:
    from octavo.simulator.report import format_comparison, format_scheduling, plot_timelines
    from octavo.simulator.simulator import BASELINE, COMPARISONS, SCHEDULING_POLICIES, SimConfig, StepCostModel, simulate
    from octavo.simulator.workload import random_workload, shared_prefix_workload, trace_workload

    if args.workload == "random":
        workload = random_workload(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed, args.request_rate)
    elif args.workload == "shared-prefix":
        workload = shared_prefix_workload(args.num_requests, args.num_prefixes, args.prefix_len, args.suffix_len,
                                          args.output_len, args.seed, args.request_rate, cold_fraction=args.cold_fraction)
    else:
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        workload = trace_workload(args.trace)
    cfg = SimConfig(
        num_kv_tokens=args.kv_tokens, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        cost=StepCostModel(args.fixed_s, args.per_token_s, args.per_kv_token_s),
        concurrency=args.concurrency, max_wait_steps=args.max_wait_steps,
    )
    recorders = {}
    if args.dashboard:  # every run of the comparisons recorded for the replay page
        from octavo.dashboard.replay import ReplayRecorder

        recorders = {p.name: ReplayRecorder() for p in (BASELINE, *(v for _, v, _ in COMPARISONS))}
    baseline = simulate(workload, BASELINE, cfg, on_step=recorders.get(BASELINE.name))
    results, report = [baseline], {"baseline": baseline.summary(), "comparisons": {}}
    print(f"{len(workload)} requests, {sum(len(w.prompt_token_ids) for w in workload)} prompt tokens, "
          f"{sum(w.output_len for w in workload)} output tokens; KV {cfg.num_kv_tokens} tokens, "
          f"block {cfg.block_size}, max_num_seqs {cfg.max_num_seqs}, budget {cfg.max_num_batched_tokens}")
    for title, variant_policy, _ in COMPARISONS:
        variant = simulate(workload, variant_policy, cfg, on_step=recorders.get(variant_policy.name))
        results.append(variant)
        report["comparisons"][title] = variant.summary()
        print("\n" + format_comparison(title, variant, baseline))
    scheduling = [simulate(workload, policy, cfg) for policy in SCHEDULING_POLICIES]
    report["scheduling"] = {r.policy: r.summary() for r in scheduling}
    print("\n" + format_scheduling(scheduling))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if args.plot:
        plot_timelines(results, args.plot)
        print(f"\nplot written to {args.plot}")
    if args.dashboard:
        from octavo.dashboard.replay import replay_html

        title = f"{args.workload}, {len(workload)} requests, KV {cfg.num_kv_tokens} tokens"
        with open(args.dashboard, "w") as fh:
            fh.write(replay_html({name: r.thinned() for name, r in recorders.items()}, title))
        print(f"\ndashboard replay written to {args.dashboard} (open it in a browser)")
    return 0


def add_workload_flags(p: argparse.ArgumentParser, with_seed: bool = True, multi_turn: bool = False) -> None:
    choices = ["random", "prefix-repetition", "code-edit", "replay"] + (["multi-turn"] if multi_turn else [])
    p.add_argument("workload", nargs="?", choices=choices, default="random")
    p.add_argument("file", nargs="?", default=None, help="replay: JSON list of {prompt_token_ids, max_tokens[, arrival_time]}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths within len x (1 +- ratio)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--cold-fraction", type=float, default=0.0,
                   help="prefix-repetition: this share of requests has a prefix of its own (cold; its TTFT reported apart)")
    if with_seed:
        p.add_argument("--seed", type=int, default=0, help="workload seed")
    if multi_turn:
        p.add_argument("--num-conversations", type=int, default=12, help="multi-turn: conversations")
        p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
        p.add_argument("--system-len", type=int, default=256, help="multi-turn: each conversation's system prompt")
        p.add_argument("--user-len", type=int, default=64, help="multi-turn: tokens of each user message")
        p.add_argument("--think-time", type=float, default=1.0, help="multi-turn: mean seconds between turns")


def load_workload(args: argparse.Namespace):
    from octavo.simulator.workload import code_edit_workload, random_workload, shared_prefix_workload, trace_workload

    if args.workload == "code-edit":  # text prompts whose answers copy them (speculative decoding's case)
        return code_edit_workload(args.num_requests, args.output_len, args.seed)
    if args.workload == "random":
        return random_workload(args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed)
    if args.workload == "prefix-repetition":
        return shared_prefix_workload(args.num_requests, args.num_prefixes, args.prefix_len, args.suffix_len,
                                      args.output_len, args.seed, cold_fraction=args.cold_fraction)
    if not args.file:
        raise ValueError("replay needs a FILE: octavo bench throughput replay ../shared/workloads/random_n64.json")
    return trace_workload(args.file)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from octavo.bench.throughput import format_results, run_hf, run_hf_cb, run_octavo
    from octavo.models.loader import resolve_model

    workload = load_workload(args)
    if any(w.prompt_text is not None for w in workload):  # text prompts: every backend gets the same ids
        from octavo.models.loader import resolve_model as _resolve
        from octavo.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(_resolve(args.model))
        workload = [dataclasses.replace(w, prompt_token_ids=tuple(tokenizer.encode(w.prompt_text)), prompt_text=None)
                    for w in workload]
    backends = [args.backend] + [b for b in (args.compare.split(",") if args.compare else []) if b and b != args.backend]
    for b in backends:
        if b not in ("octavo", "hf", "hf-cb"):
            raise ValueError(f"unknown backend {b!r}; choose from octavo, hf, hf-cb")
    print(f"{len(workload)} requests, {sum(len(w.prompt_token_ids) for w in workload)} prompt tokens, "
          f"{sum(w.output_len for w in workload)} output tokens (forced, greedy)", flush=True)
    results = []
    for b in backends:
        if b == "octavo":
            results.append(run_octavo(workload, engine_kwargs(args)))
        elif b == "hf":
            results.append(run_hf(workload, resolve_model(args.model), args.hf_batch_size))
        else:
            results.append(run_hf_cb(workload, resolve_model(args.model)))
        print(format_results(results[-1:]), flush=True)
    print("\n" + format_results(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.to_dict() for r in results], fh, indent=2)
    return 0


def cmd_bench_bandwidth(args: argparse.Namespace) -> int:
    """`octavo bench bandwidth`: this machine's read bandwidth (kept per machine; --again measures anew)."""
    import os

    from octavo.memory_bandwidth import measured

    bw = measured(args.threads or os.cpu_count() or 1, again=args.again)
    print(f"read bandwidth {bw.bytes_per_s / 1e9:.1f} GB/s: best of {bw.reps} sums of {bw.buffer_bytes / 2**30:.1f} GiB "
          f"with {bw.threads} threads ({bw.machine}; measured {bw.measured})")
    return 0


def _bench_multi_turn(args: argparse.Namespace) -> int:
    """`octavo bench serve multi-turn`: conversations on one server, or on each of --compare in turn."""
    import asyncio

    from octavo.bench.multi_turn import compare_conversations, format_turns
    from octavo.simulator.workload import multi_turn_workload

    urls = [args.base_url, *args.compare]
    labels = args.labels.split(",") if args.labels else urls
    if len(labels) != len(urls):
        raise ValueError(f"--labels names {len(labels)} servers, but there are {len(urls)}")
    rounds = [multi_turn_workload(args.num_conversations, args.turns, args.system_len, args.user_len, args.output_len,
                                  args.seed + r) for r in range(args.repeats if args.compare else 1)]
    conv = rounds[0]
    print(f"{len(conv)} conversations x {args.turns} turns; last turn {len(conv[0][-1].prompt_token_ids)} prompt tokens; "
          f"working set {sum(len(c[-1].prompt_token_ids) + args.output_len for c in conv)} tokens", flush=True)
    results = asyncio.run(compare_conversations(
        list(zip(labels, urls)), rounds, think_time=args.think_time, max_concurrency=args.max_concurrency,
        model=args.model_name, api_key=args.api_key, seed=args.seed))
    print(format_turns(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0 if all(s["failed"] == 0 for runs in results.values() for s in runs) else 1


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from octavo.bench.serve import format_summary, plot_serve, run_serve_benchmark, summarise

    if args.workload == "multi-turn":
        return _bench_multi_turn(args)
    workload = load_workload(args)
    common = dict(model=args.model_name, request_rate=args.request_rate, burstiness=args.burstiness,
                  max_concurrency=args.max_concurrency, api_key=args.api_key, seed=args.seed)
    if args.compare:
        from octavo.bench.serve import compare_servers, format_comparison

        urls = [args.base_url, *args.compare]
        labels = args.labels.split(",") if args.labels else urls
        if len(labels) != len(urls):
            raise ValueError(f"--labels names {len(labels)} servers, but there are {len(urls)}")
        # Fresh prompts each round and for the warm-up (prefix caches would turn a repeat into a hit):
        # a new seed, or for a replay file each prompt rotated by r tokens (same ids, same lengths).
        def variant(r: int):
            if args.workload != "replay":
                return load_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + r}))
            return [dataclasses.replace(w, prompt_token_ids=tuple(w.prompt_token_ids[r % len(w.prompt_token_ids):])
                                        + tuple(w.prompt_token_ids[: r % len(w.prompt_token_ids)])) for w in workload]

        rounds = [workload] + [variant(r) for r in range(1, args.repeats)]
        warmup = variant(args.repeats)[: args.warmup]
        results = asyncio.run(compare_servers(list(zip(labels, urls)), rounds, warmup, **common))
        print(format_comparison(results))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
        return 0 if all(s["failed"] == 0 for runs in results.values() for s in runs) else 1
    records, duration = asyncio.run(run_serve_benchmark(args.base_url, workload, **common))
    summary = summarise(records, duration)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    if args.plot:
        plot_serve(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if summary["failed"] == 0 else 1


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """What one HTTP client may hold of a server (octavo serve and octavo router alike)."""
    parser.add_argument("--max-request-bytes", type=parse_bytes, default=4 << 20,
                        help="largest request body (default 4MiB); larger ones get 413 without being read whole")
    parser.add_argument("--header-timeout", type=float, default=30.0,
                        help="seconds a connection may take to send a whole request head, and the longest pause "
                             "inside a request body; slower connections are closed (408 for a body)")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="open connections at most; more are answered 503 and closed (default: the descriptor "
                             "limit, raised to its hard limit, less 256)")


def _add_generate(sub) -> None:
    """`octavo generate`."""
    gen = sub.add_parser("generate", help="answer a few chat prompts offline and print engine statistics")
    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable; default: four sample questions)")
    gen.add_argument("--max-tokens", type=int, default=96, help="most tokens per answer")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--json", action="store_true", help="print answers and timings as JSON")
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    """`octavo serve`."""
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model name clients send (default: the model path, or SmolLM2-135M-Instruct); several "
                            "names serve the same model under each (the first is the one answers carry), as vLLM")
    serve.add_argument("--api-key", default=os.environ.get("OCTAVO_API_KEY") or os.environ.get("VLLM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 routes (default: "
                            "$OCTAVO_API_KEY, else vLLM's $VLLM_API_KEY)")
    serve.add_argument("--root-path", default="",
                       help="the path prefix a proxy serves this server under (e.g. /llm): routes answer with and without it")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="answer with an X-Request-Id header (the client's, or a new one) (vLLM's flag)")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, whether stream_options asks or not (vLLM's flag)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens are named 'token_id:<id>' unless a request says otherwise (vLLM's flag)")
    serve.add_argument("--override-generation-config", type=json.loads, default=None,
                       help="defaults for what requests leave unset, as JSON (vLLM's flag): max_new_tokens, "
                            "temperature, top_p, top_k, min_p, repetition_penalty")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="the most logprobs, top_logprobs or prompt_logprobs a request may ask for (0-20, default 20; "
                            "vLLM's -1 or a larger value means Octavo's own limit, 20)")
    serve.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines while busy")
    serve.add_argument("--metrics-prefix", choices=("octavo", "vllm"), default="octavo",
                       help="name /metrics as octavo:* (default) or with vLLM's names and labels (vllm:*), which "
                            "endpoint pickers (the Gateway API inference extension, llm-d, KServe) and vLLM dashboards read")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False, help="log every HTTP request")
    serve.add_argument("--max-waiting-requests", type=int, default=1024, help="requests that may wait for a slot; past it new ones get 429 with Retry-After")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true", help="report usage.prompt_tokens_details.cached_tokens (off: it tells a tenant whether another's prefix is cached)")
    serve.add_argument("--keep-alive-on-engine-death", action="store_true", help="if the engine fails, keep serving /health (503) instead of exiting with status 1")
    serve.add_argument("--enable-debug-endpoints", action="store_true", help="serve GET /debug/kv_cache (pool counts and an invariant check)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; "
                            "default: vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    serve.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how tool_choice \"auto\" reads the model's own tool calls: hermes (<tool_call>{...}</tool_call>: "
                            "Qwen, Hermes), qwen3_coder (<function=...>), llama3_json, mistral ([TOOL_CALLS]), pythonic "
                            "([f(x=1)]); see docs/API.md. Without it, Hermes' blocks are read where the chat template does "
                            "not render tools (Octavo then writes Hermes' instructions), and \"auto\" is refused where it does")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split a reasoning model's thinking (<think>...</think> and its family's spellings) into "
                            "reasoning_content, reasoning items and thinking blocks")
    serve.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                       help="what the server answers: generation and embeddings (auto, the default: any model serves "
                            "/v1/embeddings, /v1/rerank and /score beside generation, in the same batches), generation "
                            "only, or pooling only (vLLM's --runner pooling)")
    serve.add_argument("--task", choices=("generate", "embed"), default=None,
                       help="vLLM's older spelling: --task embed is --runner pooling")
    serve.add_argument("--pooling-type", choices=("last", "mean", "cls"), default="last",
                       help="how embeddings pool the final hidden states: the last token's (default; decoder embedding "
                            "models, and it takes prefix-cache hits), the mean over every token, or the first token's")
    serve.add_argument("--matryoshka", action="store_true",
                       help="the model was trained for Matryoshka embeddings: /v1/embeddings takes `dimensions` below "
                            "the hidden size (the first d values, renormalised)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's flag, accepted for its scripts: auto tool choice is on whenever --tool-call-parser is given")
    serve.add_argument("--max-stored-responses", type=int, default=1024,
                       help="/v1/responses kept in memory for previous_response_id (oldest dropped first)")
    serve.add_argument("--max-stored-response-bytes", type=parse_bytes, default=128 << 20,
                       help="...and at most this much of their JSON together (default 128MiB; oldest dropped first)")
    serve.add_argument("--dashboard-interval", type=float, default=0.25,
                       help="seconds between the live dashboard's snapshots, however many pages watch (default 0.25: "
                            "4 a second, ~0.6%% of a busy engine's time; larger is cheaper)")
    serve.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                       help="seconds a structured-output constraint may take to compile (in a child process); "
                            "past it the request gets 400 and the compile is stopped")
    add_chat_template_flags(serve)
    add_connection_flags(serve)
    serve.set_defaults(func=cmd_serve)


def add_chat_template_flags(serve: argparse.ArgumentParser) -> None:
    """How chat templates are trusted and bounded (the template itself: --chat-template)."""
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request send its own chat_template (vLLM's flag; rendered in the sandbox, in its own "
                            "worker process, under --chat-template-timeout and the render's step, size and memory bounds)")
    serve.add_argument("--chat-template-timeout", type=float, default=10.0,
                       help="seconds a chat template may take to render (in a worker process, with bounds on its loop "
                            "steps and the text it writes); past any bound the request gets 400 naming it and the "
                            "worker is replaced")


def _add_router(sub) -> None:
    """`octavo router`."""
    rt = sub.add_parser("router", help="one OpenAI endpoint in front of several `octavo serve` replicas")
    rt.add_argument("--worker", action="append", required=True, metavar="URL",
                    help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each)")
    rt.add_argument("--policy", choices=["cache-aware", "round-robin", "least-load", "kv-events"], default="cache-aware",
                    help="cache-aware: the replica already sent the longest prefix of the prompt, unless loads are uneven; "
                         "kv-events: the replica whose published KV blocks hold the longest prefix of the prompt's tokens "
                         "(replicas run --prefix-caching-hash-algo sha256_cbor --kv-events-config ...; see --kv-events-endpoint)")
    rt.add_argument("--kv-events-endpoint", action="append", default=[], metavar="PUB[,REPLAY]",
                    help="kv-events: a replica's KV event socket and, after a comma, its replay socket, e.g. "
                         "tcp://10.0.0.2:5557,tcp://10.0.0.2:5558 (one per --worker, in the same order)")
    rt.add_argument("--kv-events-topic", default="", help="kv-events: the replicas' topic")
    rt.add_argument("--model", default=None,
                    help="kv-events: the replicas' model (its tokenizer and chat template make the prompt's tokens; "
                         "default: the embedded model)")
    rt.add_argument("--block-size", type=int, default=16, help="kv-events: the replicas' KV block size")
    rt.add_argument("--kv-events-sent-ttl", type=float, default=30.0,
                    help="kv-events: seconds a prompt's blocks count as held by the replica they were sent to, until "
                         "its events report them (a burst sharing a new prefix stays together meanwhile)")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=8080)
    rt.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks of each replica")
    rt.add_argument("--request-timeout", type=float, default=1800.0,
                    help="seconds a replica may take to start answering (a whole answer, unless streamed); then 504")
    rt.add_argument("--max-connections-per-replica", type=int, default=256,
                    help="open connections to one replica at most; when all are busy for 5 s another replica is tried")
    add_connection_flags(rt)
    rt.add_argument("--cache-threshold", type=float, default=0.5, help="share of the prompt that must match to follow the cache")
    rt.add_argument("--balance-abs-threshold", type=int, default=32, help="loads are uneven past this many requests apart...")
    rt.add_argument("--balance-rel-threshold", type=float, default=1.0001, help="...and this ratio: then the least loaded replica is used")
    rt.set_defaults(func=cmd_router)


def _add_plan(sub) -> None:
    """`octavo plan`."""
    plan = sub.add_parser("plan", help="KV-cache capacity from a model's config.json: bytes per token, sequences that fit")
    plan.add_argument("config", nargs="?", default=None, help="config.json, a model directory, a .gguf file or a packaged model name (default: the embedded model)")
    plan.add_argument("--device-memory", type=parse_bytes, default=None,
                      help="device memory, e.g. 80GiB, 24GB: plan for another machine (default: what `octavo serve` "
                           "gives the KV cache on this one)")
    plan.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory for weights + KV cache")
    plan.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default=None,
                      help="KV cache dtype: float32, bfloat16, float16, int8 (a float16 scale per 32 values), fp8 (default: "
                           "what `octavo serve` would use here: the model's dtype, float32 on a CPU, bfloat16 on CUDA)")
    plan.add_argument("--weight-bytes", type=parse_bytes, default=None,
                      help="weight memory (default: a GGUF's tensors as the engine holds them; else estimated from the config)")
    plan.add_argument("--weight-dtype", default=None, help="dtype for the weight estimate (default: the KV dtype)")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    plan.add_argument("--typical-len", type=int, default=1024, help="typical prompt + output length")
    plan.add_argument("--max-len", type=int, default=8192, help="maximum sequence length (max_model_len)")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=cmd_plan)


def _add_simulate(sub) -> None:
    """`octavo simulate`."""
    sim = sub.add_parser("simulate", help="replay a workload through the real scheduler with a step-cost model")
    sim.add_argument("--workload", choices=["random", "shared-prefix", "trace"], default="random")
    sim.add_argument("--dashboard", default=None, metavar="FILE.html",
                     help="also write the live dashboard's page replaying each run (one file, no server)")
    sim.add_argument("--trace", default=None, help="JSON trace: prompt_token_ids|prompt_len, max_tokens|output_len, arrival_time")
    sim.add_argument("--num-requests", type=int, default=64)
    sim.add_argument("--input-len", type=int, default=256)
    sim.add_argument("--output-len", type=int, default=128)
    sim.add_argument("--range-ratio", type=float, default=0.5, help="random lengths within len x (1 +- ratio)")
    sim.add_argument("--num-prefixes", type=int, default=4)
    sim.add_argument("--prefix-len", type=int, default=512)
    sim.add_argument("--suffix-len", type=int, default=64)
    sim.add_argument("--cold-fraction", type=float, default=0.0,
                     help="shared-prefix: this share of requests has a prefix of its own (cold; reported apart)")
    sim.add_argument("--concurrency", type=int, default=None,
                     help="a closed loop of this many clients (each sends its next request when one ends); "
                          "arrival times are ignored")
    sim.add_argument("--max-wait-steps", type=int, default=DEFAULT_MAX_WAIT_STEPS,
                     help="cache-aware: the wait bound in steps")
    sim.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--kv-tokens", type=int, default=16384, help="KV-cache capacity in tokens, the same for every policy")
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--max-num-seqs", type=int, default=64)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--max-model-len", type=int, default=2048)
    sim.add_argument("--fixed-s", type=float, default=0.08, help="cost model: seconds per step")
    sim.add_argument("--per-token-s", type=float, default=2.3e-3, help="cost model: seconds per scheduled token")
    sim.add_argument("--per-kv-token-s", type=float, default=1.5e-5, help="cost model: seconds per attended KV token")
    sim.add_argument("--json", default=None, help="write all results as JSON to this file")
    sim.add_argument("--plot", default=None, help="write a PNG: KV memory and resident sequences over time per policy")
    sim.set_defaults(func=cmd_simulate)


def cmd_eval(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from pathlib import Path

    from octavo.bench.accuracy import (DEFAULT_TEXT, Scorer, evaluate, format_table, parse_mode, text_tokens, windows,
                                       write_kl_base)
    from octavo.kernels.kv_format import storage_dtype
    from octavo.models.loader import load_model, resolve_model
    from octavo.tokenizer import load_tokenizer

    model_dir = resolve_model(args.model)
    text = Path(args.text).read_text() if args.text else DEFAULT_TEXT.read_text()
    token_ids, bos = text_tokens(load_tokenizer(model_dir), text)
    num_windows = len(windows(token_ids, args.ctx, args.max_windows))  # refuses a text too short first
    modes = ["float32", *[m for m in args.modes.split(",") if m and m != "float32"]]
    parsed = {mode: parse_mode(mode) for mode in modes}  # an unknown mode is refused before any load
    scorers, models = {}, {}
    for mode, (activation, kv) in parsed.items():
        if activation not in models:  # one copy of the weights per activation dtype
            models[activation] = load_model(model_dir, dtype=torch.float32, activation_dtype=activation,
                                            quantization="auto")
        model, cfg = models[activation]
        scorers[mode] = Scorer(model, cfg, args.ctx, kv_dtype=storage_dtype(kv))
    with tqdm(total=num_windows, desc="Scoring windows", unit="window") as bar:
        result = evaluate(scorers, token_ids, args.ctx, max_windows=args.max_windows, progress=bar, bos=bos)
    print(f"{model_dir.name}: {format_table(result)}")
    if args.kl_base:  # the exact path's log-probabilities for llama-perplexity --kl-divergence-base
        write_kl_base(args.kl_base, scorers["float32"], token_ids, args.ctx, args.max_windows, bos)
        print(f"exact log-probabilities written to {args.kl_base} (llama-perplexity --kl-divergence-base)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": str(model_dir), "num_tokens": result.num_tokens, "ctx": result.ctx,
                       "scores": [dataclasses.asdict(s) for s in result.scores]}, fh, indent=2)
    return 0


def _add_eval(sub) -> None:
    ev = sub.add_parser("eval", help="accuracy of int8 activations or a smaller KV cache against the exact float32 "
                                      "path: KL divergence, same top token, perplexity over a fixed text")
    ev.add_argument("model", nargs="?", default=None, help="HF directory, .gguf file or packaged name (default: the embedded model)")
    ev.add_argument("--modes", default="int8", help="comma-separated modes to score against float32 (default int8): "
                    "int8 (activations), kv-bfloat16, kv-float16, kv-int8 (the KV cache's dtype), or both as int8+kv-int8")
    ev.add_argument("--text", default=None, help="a UTF-8 text file (default: octavo/bench/data/eval_text.txt, ~2k tokens)")
    ev.add_argument("--ctx", type=int, default=512, help="window length; its second half is scored (llama-perplexity's -c)")
    ev.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    ev.add_argument("--json", default=None, help="write the scores to this JSON file")
    ev.add_argument("--kl-base", default=None, help="also write the exact path's log-probabilities in llama-perplexity's "
                    "--kl-divergence-base format to this file (its KL divergence against them: tools/compare_llama_cpp.sh)")
    ev.set_defaults(func=cmd_eval)


def _add_bench(sub) -> None:
    """`octavo bench throughput`, `octavo bench bandwidth` and `octavo bench serve`."""
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, online serving latency")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline tokens/s of Octavo, transformers generate (hf) and its continuous batching (hf-cb)")
    add_workload_flags(tp, with_seed=False)
    add_engine_flags(tp, model_positional=False)
    tp.add_argument("--backend", default="octavo", help="octavo, hf or hf-cb")
    tp.add_argument("--compare", default=None, help="more backends to run in turn, e.g. hf,hf-cb; ratios are printed")
    tp.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    tp.add_argument("--json", default=None, help="write the results to this JSON file")
    tp.set_defaults(func=cmd_bench_throughput)
    bw = bench_sub.add_parser("bandwidth", help="this machine's memory read bandwidth: the floor of a decode step "
                              "(measured once, ~1 s, then kept; bench serve and the start-up line quote it)")
    bw.add_argument("--threads", type=int, default=None, help="threads reading (default: one per core)")
    bw.add_argument("--again", action="store_true", help="measure again (the kept figure is replaced)")
    bw.set_defaults(func=cmd_bench_bandwidth)
    sv = bench_sub.add_parser("serve", help="send a workload to an OpenAI-compatible server and measure TTFT, TPOT, ITL, E2E")
    add_workload_flags(sv, multi_turn=True)
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sv.add_argument("--model-name", default=None, help="model name to send (default: none; the server's own)")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once (multi-turn too)")
    sv.add_argument("--compare", action="append", default=[], metavar="URL",
                    help="another server's base URL (repeatable): the workload runs on each in turn, --repeats rounds; "
                         "medians and ratios to --base-url are printed as a table")
    sv.add_argument("--labels", default=None, help="comma-separated names for --base-url and each --compare URL")
    sv.add_argument("--repeats", type=int, default=3, help="rounds of a --compare run (default 3)")
    sv.add_argument("--warmup", type=int, default=2, help="uncounted requests each server gets before each round of a --compare run")
    sv.add_argument("--json", default=None)
    sv.add_argument("--plot", default=None, help="PNG of latency distributions and throughput over time")
    sv.set_defaults(func=cmd_bench_serve)


def build_parser() -> argparse.ArgumentParser:
    import octavo

    parser = argparse.ArgumentParser(prog="octavo", description="Serve LLMs with a paged KV cache and continuous batching.")
    parser.add_argument("--version", action="version", version=f"octavo {octavo.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_serve, _add_router, _add_plan, _add_simulate, _add_bench, _add_eval):
        add(sub)
    return parser


def _torchrun_worker(args: argparse.Namespace) -> bool:
    """Under torchrun, every rank runs the same command; ranks > 0 become the engine's workers and end
    the process when rank 0 stops them (False: this process is not such a worker)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        return False  # not under torchrun (checked before importing torch: a refused start stays light)
    from octavo.distributed.executor import torchrun_rank

    launched = torchrun_rank()
    if launched is None or launched[0] == 0 or not hasattr(args, "tensor_parallel_size"):
        return False
    from octavo.distributed.executor import run_worker_from_env
    from octavo.models.loader import resolve_activation_dtype, resolve_model

    from octavo.engine_args import resolve_device

    device = resolve_device(args.device)
    dtype = ("bfloat16" if device.startswith("cuda") else "float32") if args.dtype == "auto" else args.dtype
    quantization = "none" if device.startswith("cuda") and args.quantization == "auto" else args.quantization
    model_dir = resolve_model(args.model)
    activation_dtype, _ = resolve_activation_dtype(getattr(args, "activation_dtype", "auto"), model_dir, quantization, device)
    run_worker_from_env(str(model_dir), dtype, args.tensor_parallel_size, device, quantization, activation_dtype)
    # The worker left the group cleanly. Skip the interpreter's teardown: gloo's C++ threads can
    # abort the process in static destructors, and under torchrun a worker that exits non-zero makes
    # its node's agent skip the exit barrier, leaving the other nodes waiting for it (300 s).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    # httpx logs every request at INFO: a line per request among bench's progress bar and the router's log
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if _torchrun_worker(args):
            return 0
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
