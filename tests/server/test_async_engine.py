"""AsyncEngine on the real model: engine death fails every request (running and queued) at once,
a refusal keeps none of a multi-prompt batch, the waiting limit answers EngineOverloadedError."""

import asyncio
import threading

import pytest

from octavo.metrics import EngineMetrics
from octavo.sampling.params import RequestOutputKind, SamplingParams
from octavo.server.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError

PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _ids(tokenizer, text):
    return tokenizer.encode(text)


def test_a_failing_step_fails_running_and_queued_requests_and_refuses_new_ones(make_llm, smol_tokenizer):
    engine = make_llm().engine
    entered, release = threading.Event(), threading.Event()
    real_execute = engine.runner.execute
    calls = []

    def execute(sched, grammar=None):
        calls.append(1)
        if len(calls) == 3:  # the third step: hold it, let commands queue up, then fail
            entered.set()
            release.wait(30)
            raise RuntimeError("injected fault")
        return real_execute(sched, grammar)

    engine.runner.execute = execute
    died = []
    ae = AsyncEngine(engine, EngineMetrics("m"), on_dead=died.append)
    prompt = _ids(smol_tokenizer, "Once upon a time")

    async def main():
        ae.start()
        running = await ae.add(["a"], [prompt], PARAMS)
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        queued = [asyncio.create_task(ae.add([f"q{i}"], [prompt], PARAMS)) for i in range(3)]
        await asyncio.sleep(0.2)  # the adds sit in the command queue of the failing step
        release.set()
        outcomes = await asyncio.gather(*queued, return_exceptions=True)
        with pytest.raises(EngineDeadError, match="injected fault"):
            while await running.next_batch():
                pass
        with pytest.raises(EngineDeadError):
            await ae.add(["late"], [prompt], PARAMS)
        return outcomes

    outcomes = asyncio.run(asyncio.wait_for(main(), 60))
    assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
    assert not ae.is_healthy and len(died) == 1 and "injected fault" in str(died[0])


def test_a_refused_prompt_keeps_none_of_the_batch_and_the_waiting_limit_holds(make_llm, smol_tokenizer):
    engine = make_llm(max_num_seqs=1).engine
    ae = AsyncEngine(engine, EngineMetrics("m"), max_waiting_requests=2)
    ok = _ids(smol_tokenizer, "Hello")

    async def main():
        ae.start()
        with pytest.raises(ValueError, match=r"prompt 1: prompt token ids must be in \[0, 49152\)"):
            await ae.add(["b0", "b1"], [ok, [10**7]], PARAMS)
        assert await ae._call(lambda e: e.has_unfinished_requests()) is False  # b0 was not kept
        # one request of more prompts than the limit (a rerank of its maximum) is taken when nothing
        # waits: the limit bounds the queue, and retrying could never help it
        big = await ae.add(["x0", "x1", "x2"], [ok, ok, ok], PARAMS)
        ae.abort(["x0", "x1", "x2"])
        while await big.next_batch():
            pass
        while await ae._call(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.01)
        first = await ae.add(["r0", "r1"], [ok, ok], PARAMS)
        while await ae._call(lambda e: e.num_waiting_requests()) != 1:  # r0 runs (max_num_seqs 1), r1 waits
            await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match=r"1 requests are already waiting \(limit 2; this request adds 2\)"):
            await ae.add(["r2", "r3"], [ok, ok], PARAMS)
        ae.abort(["r0", "r1"])
        assert await first.next_batch() is not None
        while await first.next_batch():
            pass
        return await ae._call(lambda e: (e.has_unfinished_requests(), e.scheduler.kv_cache.view().check_invariants()))

    busy, problems = asyncio.run(asyncio.wait_for(main(), 60))
    ae.shutdown()
    assert busy is False and problems == []


def test_a_slow_readers_backlog_is_merged_in_one_read():
    from octavo.request import CompletionOutput, RequestMetrics, RequestOutput
    from octavo.server.async_engine import OutputCollector

    def delta(index, k, finished=False):
        outs = [CompletionOutput(index=c, text=f"t{k}.{c} ", token_ids=[k], finish_reason="length" if finished else None,
                                 logprobs=None) for c in range(2)]
        return index, RequestOutput("r", None, [1], outs, finished, 0, RequestMetrics(0.0))

    async def main():
        collector = OutputCollector(num_requests=2)
        for k in range(500):  # the reader is away while 500 steps of two prompts arrive
            collector.push(*delta(0, k, finished=k == 499))
            collector.push(*delta(1, k))
        first = await collector.next_batch()
        collector.push(*delta(1, 500, finished=True))
        second = await collector.next_batch()
        return first, second, await collector.next_batch()

    first, second, end = asyncio.run(asyncio.wait_for(main(), 10))
    assert [i for i, _ in first] == [0, 1] and end == []
    (_, p0), (_, p1) = first
    assert p0.finished and p0.outputs[1].token_ids == list(range(500))
    assert p0.outputs[0].text == "".join(f"t{k}.0 " for k in range(500)) and p0.outputs[0].finish_reason == "length"
    assert not p1.finished and p1.outputs[1].finish_reason is None and second[0][1].finished


def test_a_factory_builds_the_engine_on_the_engine_thread_and_its_errors_reach_start(make_llm, smol_tokenizer):
    """The server builds its engine on the thread that steps it (one OpenMP thread pool)."""
    built_on = []

    def factory():
        built_on.append(threading.current_thread().name)
        return make_llm().engine

    ae = AsyncEngine(factory, EngineMetrics("m"))
    assert ae.engine is None
    ae.start()
    try:
        assert built_on == ["octavo-engine"] and ae.engine is not None and ae.is_healthy
        ae.start()  # idempotent: the app's lifespan calls it again
        assert built_on == ["octavo-engine"]

        async def main():
            stream = await ae.add(["f"], [_ids(smol_tokenizer, "Hello")], PARAMS)
            tokens = 0
            while batch := await stream.next_batch():
                tokens += sum(len(out.outputs[0].token_ids) for _, out in batch)
            return tokens

        assert asyncio.run(asyncio.wait_for(main(), 60)) == PARAMS.max_tokens
    finally:
        ae.shutdown()

    def broken():
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncEngine(broken, EngineMetrics("m2")).start()
