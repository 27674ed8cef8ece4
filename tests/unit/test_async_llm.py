"""AsyncLLM: streamed deltas add up, aborts free KV blocks at once, a failing request fails alone."""
from __future__ import annotations

import asyncio

import pytest

from vllmpy import SamplingParams


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
