"""Command line: parses flags and calls the library. `octavo generate` is today's main job."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time

DEFAULT_CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in a language model, briefly.",
]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine flags named as vLLM users know them."""
    parser.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="share full KV blocks between requests by a hash of their tokens")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True, help="split long prompts into chunks that share a step with decodes")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default on CPU: 4 GiB, at most a quarter of RAM)")
    parser.add_argument("--memory-fraction", type=float, default=None, help="share of device memory for weights, activations and KV cache")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights and KV cache dtype (float32 is fastest on CPUs without bf16 units)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0, help="global random seed")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        kv_cache_memory=args.kv_cache_memory,
        memory_fraction=args.memory_fraction,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
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
    outputs = llm.chat([[{"role": "user", "content": c}] for c in chats], params, use_tqdm=not args.json)
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
        f"prefix cache hits {s.prefix_cache_hits}/{s.prefix_cache_queries} tokens; preemptions {s.num_preemptions}"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from octavo.engine import LLMEngine
    from octavo.engine_args import EngineArgs
    from octavo.metrics import EngineMetrics
    from octavo.models.loader import DEFAULT_MODEL_NAME
    from octavo.server.app import OpenAIServer, build_app
    from octavo.server.async_engine import AsyncEngine

    engine = LLMEngine.from_args(EngineArgs(**engine_kwargs(args)))
    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    server = OpenAIServer(AsyncEngine(engine, EngineMetrics(name), args.log_interval), name, args.api_key)
    config = uvicorn.Config(
        build_app(server), host=args.host, port=args.port, log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.access_log,
    )
    logging.getLogger("octavo").info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    # uvicorn handles SIGINT/SIGTERM (stop accepting, let in-flight requests finish, shut the engine
    # down), then re-raises the signal to the handlers it found. Make those no-ops so a requested
    # shutdown ends with exit status 0 rather than death by signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.Server(config).run()
    logging.getLogger("octavo").info("server stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="Serve LLMs with a paged KV cache and continuous batching.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer a few chat prompts offline and print engine statistics")
    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable; default: four sample questions)")
    gen.add_argument("--max-tokens", type=int, default=96, help="most tokens per answer")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--json", action="store_true", help="print answers and timings as JSON")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    serve.add_argument("--served-model-name", default=None, help="model name clients send (default: the model path, or SmolLM2-135M-Instruct)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines while busy")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False, help="log every HTTP request")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
