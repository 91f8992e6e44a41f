"""The compiled-grammar cache is bounded in bytes and never drops a grammar a request holds; a
grammar compiled in a child process (the server's way) equals one compiled here, a slow one is
stopped at its deadline, and a cancelled compile leaves no process behind (issue 20)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
import torch

from octavo.sampling.params import SamplingParams, StructuredOutputsParams
from octavo.structured.isolated import GrammarQueueFull, IsolatedCompiler, is_quick
from octavo.structured.manager import GrammarCacheFull, GrammarError, StructuredOutputManager
from tests.structured.schemas import PET_SCHEMA, SLOW_REGEX

MiB = 1 << 20


@dataclass
class FakeGrammar:
    memory_size_bytes: int


def regex(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"x{i}")


def test_the_cache_keeps_at_most_its_bytes_least_recently_used_first():
    manager = StructuredOutputManager(None, 100, (0,), max_bytes=10 * MiB)
    for i in range(5):
        manager.insert(regex(i), FakeGrammar(3 * MiB))
    assert [manager.lookup(regex(i)) is not None for i in range(5)] == [False, False, True, True, True]
    assert manager.stats()["num_bytes"] == 9 * MiB
    manager.lookup(regex(2))  # used: now the most recent
    manager.insert(regex(5), FakeGrammar(3 * MiB))
    assert [manager.lookup(regex(i)) is not None for i in (2, 3, 4, 5)] == [True, False, True, True]


def test_a_held_grammar_is_never_evicted_and_holds_bound_the_cache():
    manager = StructuredOutputManager(None, 100, (0,), max_bytes=10 * MiB)
    manager.insert(regex(0), FakeGrammar(4 * MiB), holder="request-0")
    manager.insert(regex(1), FakeGrammar(4 * MiB), holder="request-1")
    for i in range(2, 6):  # unheld ones come and go around the held two
        manager.insert(regex(i), FakeGrammar(1 * MiB))
    assert manager.lookup(regex(0)) is not None and manager.lookup(regex(1)) is not None
    assert manager.stats()["num_bytes"] <= 10 * MiB
    with pytest.raises(GrammarCacheFull):  # 8 MiB held + 4 MiB more would pass the bound
        manager.insert(regex(9), FakeGrammar(4 * MiB), holder="request-9")
    assert manager.lookup(regex(9)) is None and manager.stats()["num_holders"] == 2
    manager.release("request-0")
    manager.release("request-0")  # a second release is a no-op
    manager.insert(regex(9), FakeGrammar(4 * MiB), holder="request-9")
    for i in range(10, 14):
        manager.insert(regex(i), FakeGrammar(1 * MiB))
    assert manager.lookup(regex(0)) is None  # released, then pushed out
    assert manager.stats()["num_holders"] == 2 and manager.stats()["num_bytes"] <= 10 * MiB


def test_requests_hold_their_grammar_until_they_end(make_llm):
    llm = make_llm()
    engine = llm.engine
    choice = StructuredOutputsParams(choice=("yes", "no"))
    engine.add_request("a", "Is the sky blue?", SamplingParams(max_tokens=4, structured_outputs=choice))
    engine.add_request("b", "Is grass red?", SamplingParams(max_tokens=4, structured_outputs=choice))
    assert engine.structured.stats()["num_holders"] == 2
    engine.abort_request("a")
    assert engine.structured.stats()["num_holders"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.structured.stats()
    assert stats["num_holders"] == 0 and stats["num_held"] == 0 and stats["num_cached"] >= 1  # kept, unheld


@pytest.fixture(scope="module")
def isolated(smol_tokenizer):
    manager = StructuredOutputManager(smol_tokenizer, 49152, (2,))
    compiler = IsolatedCompiler(manager, timeout_s=1.0, compile_quick_here=False)
    yield compiler
    compiler.close()


@pytest.mark.parametrize("where", ["worker", "quick, in the server's process"])
def test_a_grammar_compiled_in_a_worker_or_in_process_masks_as_one_compiled_here(isolated, where):
    import xgrammar as xgr

    params = StructuredOutputsParams(json=PET_SCHEMA)
    assert is_quick(params)  # small, no regex, bounds of at most 30
    compiler = isolated if where == "worker" else IsolatedCompiler(isolated.manager, compile_quick_here=True)
    before = (compiler.num_local, compiler.num_remote)
    theirs = asyncio.run(compiler.compile(params))
    assert (compiler.num_local - before[0], compiler.num_remote - before[1]) == ((0, 1) if where == "worker" else (1, 0))
    ours = isolated.manager.compile(params)
    text = '{"name": "Rex", "species": "dog", "age": 3, "owner": {"first": "Ann", "city": "Oslo"}, "toys": []}'
    tokens = isolated.manager.tokenizer.encode(text, add_special_tokens=False)
    a, b = xgr.GrammarMatcher(theirs), xgr.GrammarMatcher(ours)
    for token in tokens:
        masks = [xgr.allocate_token_bitmask(1, 49152) for _ in range(2)]
        a.fill_next_token_bitmask(masks[0])
        b.fill_next_token_bitmask(masks[1])
        assert torch.equal(masks[0], masks[1])
        assert a.accept_token(token) and b.accept_token(token)
    assert a.is_terminated() or a.accept_token(2)


def test_a_bad_constraint_is_a_grammar_error_from_the_child_too(isolated):
    with pytest.raises(GrammarError, match="regex"):
        asyncio.run(isolated.compile(StructuredOutputsParams(regex="[a-")))


def test_a_slow_compile_is_stopped_at_its_deadline(isolated):
    start = time.monotonic()
    with pytest.raises(GrammarError, match="not compiled within 1 s"):
        asyncio.run(isolated.compile(StructuredOutputsParams(regex=SLOW_REGEX)))
    # it ends at the deadline, not after the whole compile (~15 s here): generous for a busy machine
    assert time.monotonic() - start < 15
    assert isolated.num_compiling == 0


def test_a_cancelled_compile_leaves_no_process(isolated):
    patient = IsolatedCompiler(isolated.manager, timeout_s=120.0)  # only the cancellation can stop it early

    async def scenario() -> None:
        task = asyncio.ensure_future(patient.compile(StructuredOutputsParams(regex=SLOW_REGEX + "x")))
        deadline = time.monotonic() + 30
        while patient.num_compiling == 0:  # the child has started
            assert time.monotonic() < deadline and not task.done(), "the compile never started"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(scenario())
        deadline = time.monotonic() + 5  # the compile itself would take ~15 s more
        while patient.num_compiling and time.monotonic() < deadline:
            time.sleep(0.05)
        assert patient.num_compiling == 0
    finally:
        patient.close()


def test_queued_compiles_take_turns_across_clients_and_a_clients_queue_is_bounded(isolated):
    """Round-robin: a client that queued many new schemas waits for every other client's next one;
    past max_queued_per_client its next is GrammarQueueFull (HTTP 429)."""
    pool = IsolatedCompiler(isolated.manager, max_queued_per_client=3)
    pool._workers = [None]  # no worker takes jobs: the queue is read by hand below
    jobs = {f"{c}{i}": pool._submit(StructuredOutputsParams(regex=f"{c}{i}"), c) for c, n in (("a", 3), ("b", 2), ("c", 1))
            for i in range(n)}
    with pytest.raises(GrammarQueueFull, match="3 of this client's constraints are already waiting"):
        pool._submit(StructuredOutputsParams(regex="a9"), "a")
    order = [pool._next_job().params.regex for _ in range(6)]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"], order
    assert pool.num_queued == 0 and len(jobs) == 6


def test_what_compiles_in_the_servers_process():
    assert is_quick(StructuredOutputsParams(json_object=True))
    assert is_quick(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 64}}}))
    for slow in ({"type": "string", "pattern": "(a|b){0,900}"}, {"type": "string", "maxLength": 9000},
                 {"type": "array", "items": {"type": "string"}, "minItems": 1000}, {"type": "string", "format": "email"},
                 {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)}}):
        assert not is_quick(StructuredOutputsParams(json=slow)), slow
    assert not is_quick(StructuredOutputsParams(regex="a"))
    assert not is_quick(StructuredOutputsParams(grammar='root ::= "a"'))
    assert not is_quick(StructuredOutputsParams(choice=("a", "b")))
