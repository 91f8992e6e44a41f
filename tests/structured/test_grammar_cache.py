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
from octavo.structured.isolated import IsolatedCompiler
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
    compiler = IsolatedCompiler(manager, timeout_s=1.0)
    yield compiler
    compiler.close()


def test_a_grammar_compiled_in_a_child_masks_as_one_compiled_here(isolated):
    import xgrammar as xgr

    params = StructuredOutputsParams(json=PET_SCHEMA)
    theirs = asyncio.run(isolated.compile(params))
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
