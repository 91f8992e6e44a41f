"""The /v1/responses store is bounded in bytes as well as in count (issue 20: 300 large responses
kept +1.5 GiB), oldest dropped first; one larger than the whole bound is not kept at all."""

from __future__ import annotations

from octavo.server.routes.responses import ResponseStore


def body(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i}", "output": [{"content": [{"text": text}]}]}


def test_bytes_bound_the_store_oldest_first():
    store = ResponseStore(capacity=100, max_bytes=10_000)
    for i in range(10):
        assert store.put(body(i, "x" * 1500), [{"role": "user", "content": "q" * 500}])
    assert store.num_bytes <= 10_000 and 0 < len(store) < 10
    kept = [i for i in range(10) if store.get(f"resp_{i}") is not None]
    assert kept == list(range(10 - len(kept), 10))  # the newest ones
    assert store.get("resp_9")[1] == [{"role": "user", "content": "q" * 500}]


def test_count_still_bounds_it_and_a_giant_is_not_kept():
    store = ResponseStore(capacity=3, max_bytes=1 << 20)
    for i in range(5):
        store.put(body(i), [])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert not store.put(body(99, "y" * (2 << 20)), [])
    assert store.get("resp_99") is None and len(store) == 3


def logprob_heavy(i: int) -> dict:
    """What a response with include=["message.output_text.logprobs"] and top_logprobs=5 holds: many
    small dicts and floats (5.3x their JSON's length as Python objects)."""
    entry = lambda t: {"token": f"t{t}", "logprob": -0.1 * t, "bytes": [116, 48 + t % 10]}  # noqa: E731
    logprobs = [{**entry(t), "top_logprobs": [entry(t + k) for k in range(5)]} for t in range(500)]
    return {"id": f"resp_{i}", "output": [{"content": [{"text": "x" * 2000, "logprobs": logprobs}]}]}


def test_the_bound_is_on_memory_measured_not_json_length():
    import gc
    import tracemalloc

    bound = 4 << 20
    store = ResponseStore(capacity=1024, max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(48):
            store.put(logprob_heavy(i), [{"role": "user", "content": "q" * 100}])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.num_bytes <= bound
    assert held <= bound * 1.1, f"the store holds {held / 2**20:.1f} MiB under a {bound >> 20} MiB bound"
    body, conversation = store.get("resp_47")
    assert body == logprob_heavy(47) and conversation == [{"role": "user", "content": "q" * 100}]
