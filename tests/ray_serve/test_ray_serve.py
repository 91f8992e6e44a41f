"""Octavo replicas under Ray Serve, on a real local Ray cluster the tests start and stop: a head and
a second node process on 127.0.0.1, one CPU each (one replica fits a node), driven through Ray
Serve's HTTP ingress by the real openai client.

Two replicas answer (greedy text equal to a plain `octavo serve`'s, streams too) and sit on both
nodes; a replica killed while greedy streams run: every stream finishes with a local engine's
text (those on the dead replica resumed on the other), later requests succeed, and Ray brings
the replica back; with autoscaling, load raises the replica
count from 1 to 2 and idleness lowers it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from octavo.sampling.params import SamplingParams
from tests.live_server import MODEL, free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "octavo"
PROMPT = "The three primary colours are"


def ray_cmd(*args: str, tmp: Path) -> None:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True, text=True,
                         timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smol_dir):  # smol_dir: the embedded model is converted before any replica starts
    tmp = tmp_path_factory.mktemp("ray")
    port = free_port()
    common = ["--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats"]
    ray_cmd("start", "--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", str(tmp), *common, tmp=tmp)
    try:
        ray_cmd("start", "--address", f"127.0.0.1:{port}", *common, tmp=tmp)
        ray.init(address=f"127.0.0.1:{port}", logging_level="ERROR")
        deadline = time.monotonic() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2, "the second Ray node never joined"
        http_port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield f"http://127.0.0.1:{http_port}"
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            ray_cmd("stop", "--force", tmp=tmp)


def deploy(**args) -> None:
    from octavo.ray_serve.app import build_app

    # the exact path pinned: the answers are compared with local engines of it (make_llm)
    args = {"kv_cache_memory": str(64 << 20), "max_model_len": "512", "activation_dtype": "float32",
            "kv_cache_dtype": "float32", **args}
    serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
    wait_for(lambda: replicas("RUNNING") >= int(args.get("num_replicas", args.get("min_replicas", 1))), 300,
             "the replicas to run")


def replicas(state: str = "RUNNING") -> int:
    app = serve.status().applications.get(APP)
    if app is None or "OctavoReplica" not in app.deployments:
        return 0
    return app.deployments["OctavoReplica"].replica_states.get(state, 0)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout_s} s for {what}; serve status: {serve.status().applications.get(APP)}")


def replica_actors() -> list:
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and "OctavoReplica" in a["name"]]


def test_two_replicas_on_two_nodes_answer_and_one_killed_comes_back(cluster, make_llm):
    deploy(num_replicas="2")
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=300)
    want = make_llm().generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    seen, nodes = set(), set()
    for i in range(6):  # different prefixes: the kv-aware router spreads new ones over the replicas
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"Note {i}. " * 20 + PROMPT, max_tokens=2,
                                                          temperature=0)
        seen.add(raw.headers["x-octavo-replica"])
        nodes.add(raw.headers["x-octavo-node"])
    assert len(seen) == 2 and len(nodes) == 2  # one replica per node (each needs the node's one CPU)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == want

    stories = [f"Story {i}: " + PROMPT for i in range(8)]
    story_params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    expected = [o.outputs[0].text for o in make_llm().generate(stories, story_params, use_tqdm=False)]
    results: list[tuple[str, str, str | None] | BaseException] = []  # (replica first answering, text, finish)

    def stream(i: int) -> None:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=stories[i], max_tokens=160, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            text, finish = "", None
            for chunk in raw.parse():
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
            results.append((raw.headers["x-octavo-replica"], text, finish))
        except Exception as exc:  # noqa: BLE001  (counted below)
            results.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # 160 tokens take several seconds: the streams are mid-way
    victim = replica_actors()[0]
    victim_id = victim["name"].rsplit("#", 1)[-1]
    ray.kill(ray.get_actor(victim["name"], namespace="serve"), no_restart=False)
    for t in threads:
        t.join(300)
    # every stream finishes with the text a local engine gives, the killed replica's too: greedy
    # streams resume on the other replica, spliced where the client stopped (ray_serve/resume.py)
    assert all(isinstance(r, tuple) for r in results) and len(results) == 8, results
    assert sorted(text for _, text, _ in results) == sorted(expected)
    assert all(finish == "length" for _, _, finish in results)
    assert any(replica == victim_id for replica, _, _ in results)  # some streams were on the killed one
    after = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
             for _ in range(4)]
    assert after == [want] * 4  # the surviving replica (and its retries) answer meanwhile
    wait_for(lambda: replicas("RUNNING") == 2 and victim["name"] not in {a["name"] for a in replica_actors()}, 300,
             "Ray to replace the killed replica")
    serve.delete(APP)


def test_load_adds_a_replica_and_idleness_removes_it(cluster):
    deploy(min_replicas="1", max_replicas="2", target_ongoing_requests="1", upscale_delay_s="1",
           downscale_delay_s="3")
    assert replicas() == 1
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=300)
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            client.completions.create(model=MODEL, prompt=f"Load {i}: " + PROMPT, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: replicas("RUNNING") == 2, 300, "a second replica under load")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    wait_for(lambda: replicas("RUNNING") == 1, 300, "the replica count to fall back to 1 when idle")
    serve.delete(APP)


def test_the_builder_takes_serve_runs_strings_and_names_a_wrong_key():
    """`serve run octavo.ray_serve:build_app k=v` passes strings: each engine option becomes its
    field's type (bytes with units, ints, bools), and a key that is no option is refused by name."""
    from octavo.engine_args import EngineArgs
    from octavo.ray_serve.app import _engine_kwargs, build_app

    kwargs = _engine_kwargs({"kv_cache_memory": "512MiB", "max_model_len": "2048", "enable_prefix_caching": "false",
                             "model": "gemma3-270m"}, EngineArgs)
    assert kwargs == {"kv_cache_memory": 512 << 20, "max_model_len": 2048, "enable_prefix_caching": False,
                      "model": "gemma3-270m"}
    EngineArgs(**kwargs)  # valid as the replicas will build them
    with pytest.raises(ValueError, match="unknown option 'kv_cache'"):
        build_app({"kv_cache": "1GiB"})
    with pytest.raises(ValueError, match="kv-aware or power-of-two"):
        build_app({"router": "random"})
