"""`octavo bench serve multi-turn`: conversations that resend their history, read against a live
server's own counters; and a server with a second KV tier that, stopped and started again on the
same folder, serves the conversations' prefixes from it."""

import asyncio
import os

from octavo.bench.multi_turn import format_turns, run_conversations, summarise_turns
from octavo.simulator.workload import multi_turn_workload
from tests.live_server import start_server, stop_server


def test_every_turn_resends_the_whole_history():
    (conv,) = multi_turn_workload(1, 3, system_len=10, user_len=4, answer_len=2, seed=1)
    lengths = [len(t.prompt_token_ids) for t in conv]
    assert lengths == [14, 20, 26] and all(t.output_len == 2 for t in conv)
    for before, after in zip(conv, conv[1:]):
        assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
    other = multi_turn_workload(2, 3, 10, 4, 2, seed=1)
    assert other[0] == conv and other[1][0].prompt_token_ids[:10] != conv[0].prompt_token_ids[:10]


def test_a_tier_server_serves_its_conversations_again_after_a_restart(tmp_path, smol_dir):
    # 4 conversations of up to 216 tokens (14 blocks each) in a pool of 24 blocks: turns evict each
    # other's history, which the tier keeps
    conversations = multi_turn_workload(4, 3, system_len=128, user_len=24, answer_len=8, seed=3)
    flags = ["--num-kv-blocks", "24", "--max-model-len", "384", "--kv-offload-size", str(64 << 20),
             "--kv-offload-path", str(tmp_path / "tier"), "--shutdown-timeout", "5"]
    threads = 1 if os.cpu_count() and os.cpu_count() <= 2 else 2
    server = start_server(tmp_path / "first.log", flags, threads=threads)
    try:
        records, counters, duration = asyncio.run(run_conversations(server.url, conversations, think_time=0.0,
                                                                    max_concurrency=2, progress=False))
    finally:
        stop_server(server)
    summary = summarise_turns(records, counters, duration)
    assert summary["failed"] == 0 and summary["completed"] == 12, summary["errors"]
    assert summary["hit_rate"] > 0.3 and summary["tier_hit_rate"] > 0, summary  # later turns reuse their history
    assert summary["load_wait_ms"] > 0, summary  # loads take a step: the wait per loading request is counted
    assert "KV tier closed" in (tmp_path / "first.log").read_text()
    table = format_turns({"tier": [summary]})
    assert "| TTFT p50 |" in table and "failed requests: tier: 0" in table

    server = start_server(tmp_path / "second.log", flags, threads=threads)
    try:
        first_turns = [conv[:1] for conv in conversations]
        records, counters, duration = asyncio.run(run_conversations(server.url, first_turns, think_time=0.0,
                                                                    progress=False))
    finally:
        stop_server(server)
    again = summarise_turns(records, counters, duration)
    assert again["failed"] == 0 and "kept from before" in (tmp_path / "second.log").read_text()
    assert again["tier_hit_rate"] > 0.5, again  # the pool starts empty: the hits come from the tier
