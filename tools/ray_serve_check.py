"""Octavo under Ray Serve against `octavo router`, side by side, and a replica killed mid-run.

    .venv/bin/python tools/ray_serve_check.py --requests 300

Starts a local two-node Ray cluster (a head and a second node process, one CPU each), deploys
`octavo.ray_serve:build_app` with two replicas (one per node, the kv-aware request router), and
two `octavo serve` replicas (one thread each, same flags) behind `octavo router --policy
cache-aware`. The same load runs through each: `--requests` streamed completions, 8 system
prompts (~200 tokens) each with its own question, concurrency 8. Then the Ray run again, with one
replica killed (ray.kill) a third of the way in. Prints one table: requests per second, failures,
and the prefix-cache hit rate from the answers' usage (cached prompt tokens / prompt tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.compare_router_events import free_port, start, stop_all  # noqa: E402

FLAGS = {"kv_cache_memory": "48MiB", "max_model_len": "1024"}


def workload(n: int) -> list[str]:
    rng = random.Random(1)
    topics = ["tides", "lenses", "fog signals", "keepers", "storms", "charts", "ships", "bells"]
    systems = [f"You are the guide of museum number {i}, which is about {topics[i]}. " +
               f"Answer visitors about {topics[i]} kindly, in two sentences, citing the museum's own collection. " * 10
               for i in range(8)]
    return [rng.choice(systems) + f"\nVisitor {i} asks: what should I see first?" for i in range(n)]


async def run_load(url: str, prompts: list[str], on_progress=None) -> dict:
    sem = asyncio.Semaphore(8)
    out = {"ok": 0, "failed": 0, "prompt": 0, "cached": 0}
    done = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str) -> None:
            nonlocal done
            async with sem:
                body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                try:
                    usage, finished = None, False
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                        r.raise_for_status()
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                raise RuntimeError(chunk["error"]["message"])
                            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
                            usage = chunk.get("usage") or usage
                    if not finished or usage is None:
                        raise RuntimeError("the stream ended without finishing")
                    out["ok"] += 1
                    out["prompt"] += usage["prompt_tokens"]
                    out["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                except Exception:  # noqa: BLE001  (counted)
                    out["failed"] += 1
                done += 1
                if on_progress is not None:
                    on_progress(done)
        start_s = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        out["seconds"] = time.perf_counter() - start_s
    return out


def ray_cluster(tmp: Path):
    import ray
    from ray import serve

    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    port = free_port()
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats"]
    subprocess.run([ray_bin, "start", "--head", "--port", str(port), "--include-dashboard=false", "--temp-dir",
                    str(tmp / "ray"), *common], env=env, check=True, capture_output=True)
    subprocess.run([ray_bin, "start", "--address", f"127.0.0.1:{port}", *common], env=env, check=True,
                   capture_output=True)
    ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR")
    http_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    return f"http://127.0.0.1:{http_port}", lambda: subprocess.run([ray_bin, "stop", "--force"], env=env,
                                                                    capture_output=True)


def deploy_ray() -> None:
    from ray import serve

    from octavo.ray_serve.app import build_app

    serve.run(build_app({"num_replicas": "2", "served_model_name": "m", "enable_prompt_tokens_details": "true",
                         **FLAGS}), name="octavo", route_prefix="/", blocking=False)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        app = serve.status().applications.get("octavo")
        if app and app.deployments.get("OctavoReplica") and app.deployments["OctavoReplica"].replica_states.get(
                "RUNNING", 0) == 2 and app.status == "RUNNING":
            return
        time.sleep(0.5)
    raise RuntimeError("the Ray replicas never ran")


def router_run(tmp: Path, prompts: list[str]) -> dict:
    py = [sys.executable, "-m", "octavo.cli"]
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            procs.append(start(py + ["serve", "--port", str(port), "--served-model-name", "m",
                                     "--enable-prompt-tokens-details", "--kv-cache-memory", FLAGS["kv_cache_memory"],
                                     "--max-model-len", FLAGS["max_model_len"], "--log-interval", "60"],
                               tmp / f"serve{i}.log", url))
            urls.append(url)
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(start(py + ["router", "--port", str(port), *[a for u in urls for a in ("--worker", u)]],
                           tmp / "router.log", router))
        return asyncio.run(run_load(router, prompts))
    finally:
        stop_all(procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    import ray
    from ray import serve

    tmp = Path(tempfile.mkdtemp(prefix="ray-serve-check-"))
    prompts = workload(args.requests)
    rows = {"octavo router (cache-aware)": router_run(tmp, prompts)}
    url, stop = ray_cluster(tmp)
    try:
        deploy_ray()
        rows["Ray Serve (kv-aware)"] = asyncio.run(run_load(url, prompts))
        serve.delete("octavo")
        deploy_ray()
        killed = []

        def kill_once(done: int) -> None:
            if done == len(prompts) // 3 and not killed:
                name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                            if a["namespace"] == "serve" and "OctavoReplica" in a["name"])
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
                killed.append(name)
        rows["Ray Serve (kv-aware), a replica killed"] = asyncio.run(run_load(url, prompts, kill_once))
        app = serve.status().applications["octavo"].deployments["OctavoReplica"]
        back = app.replica_states
    finally:
        serve.shutdown()
        ray.shutdown()
        stop()
    print(f"| {args.requests} streamed requests, concurrency 8 | req/s | failed | prefix-cache hit rate |")
    print("| --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['ok'] / r['seconds']:.2f} | {r['failed']} | {r['cached'] / max(r['prompt'], 1):.1%} |")
    base = rows["octavo router (cache-aware)"]
    ray_row = rows["Ray Serve (kv-aware)"]
    print(f"Ray / router throughput: {(ray_row['ok'] / ray_row['seconds']) / (base['ok'] / base['seconds']):.3f}; "
          f"replicas after the kill: {back}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
