"""Dashboard snapshots on tiny pools (no model): the exact state of every block after a prompt,
a fork, a finish (cached), an eviction, a preemption and a pin; aggregation of big pools; the
step log's bound."""

from octavo.config import SchedulerConfig
from octavo.dashboard.snapshot import aggregate, block_tokens, build_snapshot
from octavo.outputs import StepLog, StepRecord
from octavo.kv_cache.manager import KVCacheManager
from octavo.outputs import ModelRunnerOutput
from octavo.request import FinishReason
from octavo.scheduler import Scheduler
from tests.helpers import make_request

BS = 4


def make(num_blocks=8, budget=64, max_model_len=64):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_model_len,
                          admission_headroom_steps=0)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS))


def step(s, token=7):
    out = s.schedule()
    s.update(out, ModelRunnerOutput(tokens={sid: [token] for e in out.scheduled for sid in e.sample_ids}))
    return out


def cells(s):
    return build_snapshot(s, StepLog())["pool"]["cells"]


def test_block_states_through_a_fork_a_finish_and_an_eviction():
    s = make()
    s.add_request(make_request("a", list(range(10)), max_tokens=3, n=2))  # 10 tokens: blocks 0, 1 full + 2 partial
    assert cells(s) == "ffffffff"
    step(s)  # the prompt: computed, then forked into two sequences sharing all three blocks
    snap = build_snapshot(s, StepLog())
    assert snap["pool"]["cells"] == "sssfffff"
    assert snap["num_running"] == 2 and {r["seq"] for r in snap["running"]} == {"a#0", "a#1"}
    assert snap["pool"]["num_shared_owners"] == {"0": 2, "1": 2, "2": 2}
    small = build_snapshot(s, StepLog(), max_cells=4)["pool"]  # 2 blocks a cell: drawn by state alone
    assert small["cells"] == "ssff" and small["blocks_per_cell"] == 2 and small["owners"] is None
    step(s)  # each writes its next token into the shared partial block: one copies it (copy-on-write)
    assert cells(s) == "ssuuffff"
    for _ in range(2):
        step(s)
    assert s.requests == {}
    # ended: full blocks stay cached (ref 0, hash kept). Both sequences' third blocks hold the same
    # tokens (8, 9, 7, 7): one hash, so one of them is cached and the other is free
    assert cells(s) == "ccfcffff"
    # a request of 7 blocks takes the 5 free ones and evicts 2 of the 3 cached
    s.add_request(make_request("b", list(range(100, 128)), max_tokens=2))
    step(s)
    counts = build_snapshot(s, StepLog())["pool"]["counts"]
    assert (counts["used"], counts["cached"], counts["free"]) == (7, 1, 0)


def test_preemption_and_pins_show():
    s = make(num_blocks=6, budget=64)
    s.add_request(make_request("a", list(range(8)), max_tokens=12))
    s.add_request(make_request("b", list(range(50, 58)), max_tokens=12))
    for _ in range(6):
        step(s)
    snap = build_snapshot(s, StepLog())
    assert s.preemption.num_preemptions > 0
    assert snap["num_waiting"] + snap["num_running"] == 2
    assert [r["preemptions"] for r in snap["running"] + snap["waiting"] if r["preemptions"]]
    counts = snap["pool"]["counts"]
    assert sum(counts.values()) == 6 and counts["used"] == sum(r["num_blocks"] for r in snap["running"])
    s.finish_requests(list(s.requests), FinishReason.ABORT)
    s.kv_cache.pins.max_blocks = 2
    pin = make_request("p", list(range(200, 208)), max_tokens=1)
    pin.pin = True
    s.add_request(pin)
    step(s)
    assert cells(s).count("p") == 2  # its two full prompt blocks are pinned for good


def test_owners_colours_and_block_tokens():
    s = make()
    s.add_request(make_request("a", list(range(5)), max_tokens=4))
    step(s)
    snap = build_snapshot(s, StepLog())
    (row,) = snap["running"]
    assert snap["pool"]["owners"][:2] == [row["color"], row["color"]] and row["tables"] == [{"skipped": 0, "ids": [0, 1]}]
    holders, tokens = block_tokens(s, 1)
    assert holders == ["a"] and tokens == [4, 7]  # the prompt's last token, then the sampled one
    assert block_tokens(s, 5) is None


def test_big_pools_aggregate_and_the_step_log_is_bounded():
    assert aggregate("ffffcfuc", 4) == ("ffcu", 2) and aggregate("fu", 4) == ("fu", 1)
    import random

    rng = random.Random(0)
    for _ in range(200):  # against the plain definition: a cell is its liveliest block
        states = "".join(rng.choice("fcpus") for _ in range(rng.randint(1, 300)))
        max_cells = rng.randint(1, 40)
        per = max(1, -(-len(states) // max_cells))
        expected = "".join(min(states[i : i + per], key="supcf".index) for i in range(0, len(states), per))
        assert aggregate(states, max_cells) == (expected, per)
    cells_, per = aggregate("f" * 10_000 + "u" * 10_000, 4096)
    assert per == 5 and len(cells_) <= 4096 and cells_.count("u") == 2000
    log = StepLog(maxlen=3)
    for i in range(10):
        log.add(StepRecord(i, float(i), 0.01, 1, 2, 3, 0))
    assert [r.step for r in log.records] == [7, 8, 9]


def test_a_simulated_run_is_recorded_for_the_replay_page():
    from octavo.dashboard.replay import ReplayRecorder, replay_html
    from octavo.simulator.simulator import BASELINE, Policy, SimConfig, simulate
    from octavo.simulator.workload import random_workload

    workload = random_workload(12, 64, 24, seed=1)
    cfg = SimConfig(num_kv_tokens=1024, block_size=16, max_num_seqs=6, max_num_batched_tokens=256, max_model_len=256)
    paged, reserved = ReplayRecorder(), ReplayRecorder()
    result = simulate(workload, BASELINE, cfg, on_step=paged)
    simulate(workload, Policy("reserve max length", paged=False), cfg, on_step=reserved)
    assert len(paged.frames) == result.num_steps
    first, last = paged.frames[0], paged.frames[-1]
    assert first["pool"]["counts"]["used"] > 0 and first["num_running"] > 0
    assert last["num_running"] == last["num_waiting"] == 0 and last["pool"]["counts"]["used"] == 0
    assert [f["time"] for f in paged.frames] == sorted(f["time"] for f in paged.frames)
    thinned = paged.thinned(max_frames=10)
    assert len(thinned) == 10 and thinned[-1] is last
    # reserving max_model_len per request: whole-sequence blocks, fewer requests at once
    assert reserved.frames[0]["pool"]["block_size"] > first["pool"]["block_size"]
    html = replay_html({"paged": paged.thinned(), "reserved": reserved.thinned()}, "test run")
    assert "window.OCTAVO_REPLAY = {" in html and "/dashboard/static/" not in html and "</script>" in html


def test_sliding_window_groups_show_the_blocks_their_window_gave_back():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, admission_headroom_steps=0)
    s = Scheduler(cfg, KVCacheManager(32, BS, group_windows=(None, 5)))  # a global group and a window of 5
    s.add_request(make_request("a", list(range(20)), max_tokens=4))
    step(s)
    step(s)  # a window gives back blocks as the next step starts past them
    (row,) = build_snapshot(s, StepLog())["running"]
    # 21 tokens (6 blocks): the global group holds all; the window of 5 keeps the blocks of
    # positions 16.. and gave the first 4 back
    assert row["groups"] == [[6, 0], [2, 4]]
    snap = build_snapshot(s, StepLog())
    (row,) = snap["running"]
    global_ids, window_ids = row["tables"][0]["ids"], row["tables"][1]["ids"]
    assert len(global_ids) == 6 and None not in global_ids
    assert window_ids[:4] == [None] * 4 and None not in window_ids[4:]
    pool = snap["pool"]
    assert [pool["groups"][b] for b in global_ids] == [0] * 6 and [pool["groups"][b] for b in window_ids[4:]] == [1, 1]
    assert pool["groups"].count(-1) == 32 - 8  # every block not held belongs to no group
    # the four window blocks given back: counted, listed, and cached (their full blocks keep their hash)
    freed = pool["window_freed"]
    assert freed["total"] == 4 and len(freed["recent"]) == 4 and all(pool["cells"][b] == "c" for b in freed["recent"])
    assert not set(freed["recent"]) & set(global_ids + window_ids)
    assert build_snapshot(make(), StepLog())["running"] == []  # one group: no per-group counts
    s2 = make()
    s2.add_request(make_request("b", 5, max_tokens=2))
    step(s2)
    assert build_snapshot(s2, StepLog())["running"][0]["groups"] is None


def test_long_tables_list_their_latest_entries(monkeypatch):
    from octavo.dashboard import snapshot as snapshot_module

    s = make(num_blocks=64, budget=512, max_model_len=256)
    s.add_request(make_request("a", list(range(4 * 40)), max_tokens=2))  # 40 full blocks
    step(s)
    monkeypatch.setattr(snapshot_module, "MAX_TABLE", 16)
    (row,) = build_snapshot(s, StepLog())["running"]
    (table,) = row["tables"]
    assert row["num_blocks"] == 40 and table["skipped"] == 40 - 16
    assert table["ids"] == s.kv_cache.block_tables("a")[0][-16:]


def test_the_second_tiers_slots():
    from octavo.kv_cache.tier import TierIndex

    tier = TierIndex(6)
    keys = [(0, bytes([i])) for i in range(4)]
    slots = [tier.reserve(k) for k in keys]
    assert tier.slot_states() == "wwww.."
    for slot in slots[:3]:
        tier.commit(slot, True)
    tier.pin(keys[0])  # a load reads it
    assert tier.slot_states() == "lrrw.."
    tier.unpin(keys[0], ok=True)
    tier.commit(slots[3], False)  # a failed write: the tier shrinks to the 3 it holds
    assert tier.num_slots == 3 and tier.slot_states() == "rrr"
    # aggregated, a cell shows its liveliest slot: a load, then a write, then ready, then empty
    assert aggregate("..r.w.l.", 4, "lwr.") == (".rwl", 2)
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, admission_headroom_steps=0)
    s = Scheduler(cfg, KVCacheManager(8, BS, tier=TierIndex(5)))
    view = build_snapshot(s, StepLog())["tier"]
    assert view["cells"] == "....." and view["counts"] == {"empty": 5, "writing": 0, "ready": 0, "reading": 0}
