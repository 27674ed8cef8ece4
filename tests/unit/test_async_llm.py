"""AsyncLLM: streamed deltas add up, aborts free KV blocks at once, a failing request fails alone, a
caller that leaves while its add is queued cannot kill the loop, and a dead loop fails everyone at once."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from vllmpy import SamplingParams
from vllmpy.engine.fault_injection import ENV_VAR

FAIL_MARKER = [7001, 7002, 7003]  # a prompt holding these ids fails inside the step (fault injection)
DIE_MARKER = [7004, 7005, 7006]  # ... and these kill the engine loop


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from vllmpy.config import EngineConfig
    from vllmpy.engine.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig.from_kwargs(model=tiny_llama_dir, num_blocks=64, max_model_len=256))
    yield llm
    llm.shutdown()


def _blocks_all_free(engine) -> bool:
    kv = engine.engine.core.scheduler.kv
    return kv.num_free_blocks == kv.num_blocks


async def _collect(engine, prompt, params, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


def test_delta_stream_adds_up_to_cumulative(engine):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    async def main():
        return await asyncio.gather(_collect(engine, "Once upon", params, delta=True),
                                    _collect(engine, "Once upon", params))

    deltas, cumulative = asyncio.run(main())
    assert "".join(d.outputs[0].text for d in deltas) == cumulative[-1].outputs[0].text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == cumulative[-1].outputs[0].token_ids
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_abort_mid_decode_frees_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in engine.generate("Tell me a long story", params):
            seen += 1
            if seen == 3:
                break  # the consumer leaves, as a disconnecting client does
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.engine.has_unfinished_requests():
                break
        return seen

    assert asyncio.run(main()) == 3
    assert not engine.engine.has_unfinished_requests()
    assert _blocks_all_free(engine)


def test_failing_request_fails_alone(engine):
    good = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    bad = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={5: float("nan")})

    async def main():
        return await asyncio.gather(_collect(engine, "Hello there", good), _collect(engine, "Hello there", bad),
                                    _collect(engine, "General Kenobi", good))

    first, failed, third = asyncio.run(main())
    assert failed[-1].finished and failed[-1].outputs[0].finish_reason == "error"
    assert "sampling failed" in failed[-1].error
    assert len(first[-1].outputs[0].token_ids) == 8 and len(third[-1].outputs[0].token_ids) == 8
    assert _blocks_all_free(engine)


def test_bad_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, list(range(300)), SamplingParams(max_tokens=4))
        return await _collect(engine, "Still alive?", SamplingParams(max_tokens=3, ignore_eos=True))

    assert len(asyncio.run(main())[-1].outputs[0].token_ids) == 3


def _detokenizing_threads(monkeypatch) -> list[str]:
    """The thread of every IncrementalDetokenizer.add_tokens call from now on."""
    from vllmpy.tokenizer import IncrementalDetokenizer

    threads: list[str] = []
    real = IncrementalDetokenizer.add_tokens

    def counted(self, new_ids):
        threads.append(threading.current_thread().name)
        return real(self, new_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", counted)
    return threads


def test_text_without_stop_strings_is_made_by_the_caller(engine, monkeypatch):
    """No stop strings: the engine loop does no detokenization, and the caller's text (cumulative and as
    deltas, n = 2) is the one the engine makes when a stop string that never matches needs its text."""
    threads = _detokenizing_threads(monkeypatch)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(_collect(engine, "Once upon", params), _collect(engine, "Once upon", params,
                                                                                     delta=True))

    cumulative, deltas = asyncio.run(main())
    assert threads and "vllmpy-engine" not in threads
    threads.clear()
    in_engine = asyncio.run(_collect(engine, "Once upon", params.clone(stop=["\x00never"])))
    assert set(threads) == {"vllmpy-engine"}
    for index in (0, 1):
        text = cumulative[-1].outputs[index].text
        assert text and text == in_engine[-1].outputs[index].text
        assert "".join(c.text for d in deltas for c in d.outputs if c.index == index) == text


def test_outputs_are_snapshots(engine):
    """Each output keeps its own step's metrics and logprobs, though the caller reads them after later steps."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = asyncio.run(_collect(engine, "Hello there", params))
    assert [len(o.outputs[0].logprobs) for o in outputs] == [len(o.outputs[0].token_ids) for o in outputs]
    times = [o.metrics.last_token_time for o in outputs]
    assert times == sorted(times) and len(set(times)) == len(times) == 6
    assert [o.metrics.num_generation_tokens for o in outputs] == list(range(1, 7))


def test_stop_string_still_cuts_exactly(engine, monkeypatch):
    threads = _detokenizing_threads(monkeypatch)
    free = asyncio.run(_collect(engine, "Hello there", SamplingParams(temperature=0.0, max_tokens=16,
                                                                      ignore_eos=True)))[-1].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    cut = asyncio.run(_collect(engine, "Hello there", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                     stop=[stop])))[-1].outputs[0]
    assert "vllmpy-engine" in threads
    assert cut.text == free.text[:free.text.find(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def _engine_config(tiny_llama_dir, **kwargs):
    from vllmpy.config import EngineConfig

    return EngineConfig.from_kwargs(model=tiny_llama_dir, num_blocks=64, max_model_len=256, **kwargs)


async def _within(awaitable, seconds: float = 20.0):
    """A hang (a dead engine loop) fails the test instead of blocking it."""
    return await asyncio.wait_for(awaitable, seconds)


def test_disconnect_while_add_is_queued_keeps_engine_alive(engine):
    """The issue-22 race: the caller is cancelled while its add command waits behind a running step."""
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def held_step():
        in_step.set()
        release.wait(10)
        return real_step()

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        engine.engine.step = held_step
        try:
            busy = asyncio.ensure_future(_collect(engine, "A busy request", params))
            while not in_step.is_set():
                await asyncio.sleep(0.005)
            victim = asyncio.ensure_future(_collect(engine, [5, 6, 7], SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.05)  # its add command is queued; the engine is inside a step
            victim.cancel()
            await asyncio.wait([victim])
        finally:
            release.set()
            engine.engine.step = real_step
        busy_outputs = await _within(busy)
        fresh = await _within(_collect(engine, "A new request", params))
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        return victim, busy_outputs, fresh

    victim, busy_outputs, fresh = asyncio.run(main())
    assert victim.cancelled()
    assert not engine.errored and engine._thread.is_alive()
    assert len(busy_outputs[-1].outputs[0].token_ids) == 4 and len(fresh[-1].outputs[0].token_ids) == 4
    assert not engine.engine.has_unfinished_requests()  # the victim was added, then aborted behind it
    assert _blocks_all_free(engine)


def test_failing_command_fails_only_its_request(engine, monkeypatch):
    real_add = engine.engine.add_request

    def add_request(request_id, *args, **kwargs):
        if request_id == "broken":
            raise KeyError("a bug while adding")
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", add_request)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        with pytest.raises(RuntimeError, match="request broken failed inside the engine: KeyError"):
            await _within(_collect(engine, "Hello", params, request_id="broken"))
        return await _within(_collect(engine, "Hello", params))

    assert len(asyncio.run(main())[-1].outputs[0].token_ids) == 3
    assert not engine.errored


def _run_to_end(llm_engine) -> dict:
    finals = {}
    while llm_engine.has_unfinished_requests():
        for output in llm_engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def _assert_failed_alone(finals: dict, failed: str, cause: str, max_tokens: int) -> None:
    bad = finals.pop(failed)
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error.startswith(f"request {failed}: ") and cause in bad.error
    for output in finals.values():
        assert output.error is None and len(output.outputs[0].token_ids) == max_tokens


def test_failed_forward_fails_the_requests_of_its_step_only(tiny_llama_dir, monkeypatch):
    """Attribution of a batch-level failure: the requests scheduled in that step fail, others go on."""
    from vllmpy.engine.llm_engine import LLMEngine

    llm_engine = LLMEngine(_engine_config(tiny_llama_dir, max_num_seqs=1))  # one request per step
    runner = llm_engine.core.runner
    real_execute = runner.execute

    def execute(scheduler_output):
        if any(c.req_id == "doomed" for c in scheduler_output.chunks):
            raise RuntimeError("kernel exploded")
        return real_execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", execute)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for request_id in ("doomed", "waiting-1", "waiting-2"):
        llm_engine.add_request(request_id, "Once upon a time", params)
    finals = _run_to_end(llm_engine)
    _assert_failed_alone(finals, "doomed", "its step's forward raised RuntimeError: kernel exploded", 5)
    assert set(finals) == {"waiting-1", "waiting-2"}
    kv = llm_engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def _inject_processing_fault(monkeypatch) -> str:
    monkeypatch.setenv(ENV_VAR, json.dumps({"fail": FAIL_MARKER}))
    return "output processing raised InjectedFault: injected fault (request bad)"


def _break_stop_check(monkeypatch) -> str:
    from vllmpy.engine import stop

    real_check = stop.check_stop

    def check_stop(request, token_id, max_model_len, grammar_terminated):
        if request.request_id == "bad":
            raise IndexError("a stop check bug")
        return real_check(request, token_id, max_model_len, grammar_terminated)

    monkeypatch.setattr(stop, "check_stop", check_stop)
    return "its stop check raised IndexError: a stop check bug"


@pytest.mark.parametrize("inject", [_inject_processing_fault, _break_stop_check])
def test_per_request_failure_in_a_shared_step_fails_alone(tiny_llama_dir, monkeypatch, inject):
    from vllmpy.engine.llm_engine import LLMEngine

    cause = inject(monkeypatch)
    llm_engine = LLMEngine(_engine_config(tiny_llama_dir))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm_engine.add_request("good-1", [1, 2, 3, 4], params)
    llm_engine.add_request("bad", [1, *FAIL_MARKER, 4], params)
    llm_engine.add_request("good-2", [1, 9, 3, 4], params)
    finals = _run_to_end(llm_engine)
    _assert_failed_alone(finals, "bad", cause, 6)
    assert set(finals) == {"good-1", "good-2"}
    kv = llm_engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_dead_loop_fails_waiting_and_new_requests_at_once(tiny_llama_dir, monkeypatch):
    from vllmpy.engine.async_llm import AsyncLLM, EngineDeadError

    monkeypatch.setenv(ENV_VAR, json.dumps({"die": DIE_MARKER}))
    llm = AsyncLLM(_engine_config(tiny_llama_dir))
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        waiting = asyncio.ensure_future(_collect(llm, "A long story", long))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError, match="InjectedEngineDeath: injected engine death"):
            await _within(_collect(llm, [1, *DIE_MARKER], long))
        with pytest.raises(EngineDeadError, match="injected engine death"):
            await _within(waiting)
        with pytest.raises(EngineDeadError, match="injected engine death"):
            await _within(_collect(llm, "Anyone there?", long), 1.0)

    try:
        asyncio.run(main())
        assert llm.errored and "injected engine death" in llm.death
    finally:
        llm.shutdown()
