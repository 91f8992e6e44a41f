"""The live dashboard on the shared live server: the page is open, its data is behind the API key;
snapshots show a running request's blocks in use and, once it has ended, its full blocks cached;
the event stream sends no more than about 4 snapshots a second; a held block's text is shown to
the key's holder."""

import json
import threading
import time

import httpx
import openai
import pytest

from tests.live_server import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def snapshot(url: str) -> dict:
    resp = httpx.get(f"{url}/dashboard/snapshot", headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_page_is_open_and_its_data_needs_the_key(live_server):
    page = httpx.get(f"{live_server.url}/dashboard", timeout=30)
    assert page.status_code == 200 and "<canvas id=\"pool\"" in page.text and "sk-" not in page.text
    for path in ("/dashboard/snapshot", "/dashboard/events", "/dashboard/blocks/0"):
        assert httpx.get(f"{live_server.url}{path}", timeout=30).status_code == 401, path
    assert httpx.get(f"{live_server.url}/dashboard/static/dashboard.js", timeout=30).status_code == 200
    assert httpx.get(f"{live_server.url}/dashboard/static/../../guard.py", timeout=30).status_code in (401, 404)


def test_a_request_is_seen_running_then_its_blocks_cached(live_server):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY)
    prompt = "Count slowly from one to one hundred, one number per line: one, two, three, " * 4
    done = threading.Event()

    def run():
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=160, temperature=0, extra_body={"ignore_eos": True})
        done.set()

    threading.Thread(target=run, daemon=True).start()
    seen = None
    deadline = time.monotonic() + 180  # generous: the machine may be busy
    while seen is None and not done.is_set() and time.monotonic() < deadline:
        snap = snapshot(live_server.url)
        mine = [r for r in snap["running"] if r["prompt"] > 60 and r["output"] > 0]
        if mine:
            seen = (snap, mine[0])
        time.sleep(0.1)
    assert seen is not None, "the request never showed as running with output (it finished or the stream stalled)"
    snap, row = seen
    cells = snap["pool"]["cells"]
    (table,) = row["tables"]  # SmolLM2: one KV group, every entry a held block
    blocks = table["ids"]
    assert table["skipped"] == 0 and row["num_blocks"] == len(blocks) >= 4 and all(cells[b] in "us" for b in blocks)
    assert all(snap["pool"]["owners"][b] == row["color"] for b in blocks if cells[b] == "u")
    info = httpx.get(f"{live_server.url}/dashboard/blocks/{blocks[0]}", headers=AUTH, timeout=30).json()
    assert info["holders"] and "Count slowly" in info["text"]
    assert done.wait(180), "the request did not finish"
    after = snapshot(live_server.url)
    assert row["seq"] not in {r["seq"] for r in after["running"]}
    full = blocks[: row["prompt"] // 16]  # its full prompt blocks: cached now (or taken by whoever runs)
    taken = {b for r in after["running"] for b in r["tables"][0]["ids"]}
    assert all(after["pool"]["cells"][b] == "c" or b in taken for b in full)


def test_event_stream_is_throttled(live_server):
    events, start = 0, time.monotonic()
    with httpx.stream("GET", f"{live_server.url}/dashboard/events", headers=AUTH, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                events += 1
            if time.monotonic() - start > 2.0:
                break
    elapsed = time.monotonic() - start
    assert 1 <= events <= 4 * elapsed + 2, (events, elapsed)


def test_the_snapshot_interval_is_bounded():
    from octavo.server.core import ServerLimits

    assert ServerLimits().dashboard_interval_s == 0.25  # 4 a second
    for bad in (0.0, -1.0, 61.0):
        with pytest.raises(ValueError, match="--dashboard-interval must be between 0.01 and 60 seconds"):
            ServerLimits(dashboard_interval_s=bad)
