"""A multi-prompt /v1/completions request submits its prompts together (so they share prefill steps), and a
refusal or a client leaving while they start closes every stream that did start."""
from __future__ import annotations

import asyncio

import pytest

from vllmpy.entrypoints.openai import serving_completion
from vllmpy.entrypoints.openai.serving_engine import EngineStream


class _Stream(EngineStream):
    def __init__(self) -> None:  # no engine behind it: only aclose is observed
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class _Request:
    stream = False


class _Ctx:
    """start() of prompt i waits until every prompt has been submitted, unless told to fail or hang."""

    def __init__(self, count: int, fail: set[int] = frozenset(), hang: set[int] = frozenset()) -> None:
        self.count, self.fail, self.hang = count, fail, hang
        self.submitted: list[str] = []
        self.streams: list[_Stream] = []
        self.all_in = asyncio.Event()

    async def start(self, prompt, params, request, request_id, *, delta, renames):
        self.submitted.append(request_id)
        if len(self.submitted) == self.count:
            self.all_in.set()
        await self.all_in.wait()  # a one-at-a-time caller never gets here for prompt 2
        index = int(request_id.rsplit("-", 1)[1])
        if index in self.fail:
            raise ValueError(f"prompt {index} refused")
        if index in self.hang:
            await asyncio.Event().wait()
        stream = _Stream()
        self.streams.append(stream)
        return stream


def _start(ctx: _Ctx, count: int):
    prompts = [{"prompt_token_ids": [1, 2]} for _ in range(count)]
    return serving_completion._start_all(ctx, _Request(), None, prompts, "cmpl-x", {})


def test_prompts_start_together():
    async def run():
        ctx = _Ctx(3)
        streams = await asyncio.wait_for(_start(ctx, 3), timeout=5)
        assert ctx.submitted == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
        assert len(streams) == 3 and not any(s.closed for s in streams)
    asyncio.run(run())


def test_a_refusal_closes_the_started_streams():
    async def run():
        ctx = _Ctx(3, fail={1})
        with pytest.raises(ValueError, match="prompt 1 refused"):
            await asyncio.wait_for(_start(ctx, 3), timeout=5)
        assert len(ctx.streams) == 2 and all(s.closed for s in ctx.streams)
    asyncio.run(run())


def test_client_leaving_while_starting_closes_the_started_streams():
    async def run():
        ctx = _Ctx(2, hang={1})
        task = asyncio.ensure_future(_start(ctx, 2))
        while not ctx.streams:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(ctx.streams) == 1 and ctx.streams[0].closed
    asyncio.run(run())
