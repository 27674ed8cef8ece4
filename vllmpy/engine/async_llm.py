"""AsyncLLM: the engine loop in one background thread, outputs fanned out to per-request asyncio queues.

The thread owns the LLMEngine; callers only enqueue commands (add, abort), so no engine state is
shared across threads. An exception inside a step fails the requests of that step, not the loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from vllmpy.config import EngineConfig
from vllmpy.engine.llm_engine import EngineStats, LLMEngine, PromptType
from vllmpy.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams

logger = logging.getLogger("vllmpy")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="vllmpy-engine", daemon=True)
        self._thread.start()

    @property
    def errored(self) -> bool:
        return not self._thread.is_alive() and not self._stopped

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | PoolingParams,
                       request_id: str | None = None, priority: int = 0,
                       delta: bool = False) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Yield outputs until finished: cumulative, or only what is new since the last yield (delta).

        Leaving the iteration early (a client disconnect cancels it) aborts the request and frees its
        KV blocks.
        """
        request_id = request_id or f"req-{self.engine.new_request_id()}"
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        added: Future = Future()
        self._send(("add", request_id, prompt, sampling_params, priority, added))
        try:
            await asyncio.wrap_future(added)  # raises the engine's ValueError for a bad request
            sent: dict[int, tuple[int, int]] = {}
            while True:
                output = await stream.queue.get()
                if isinstance(output, BaseException):
                    raise output
                yield _delta(output, sent) if delta else output
                if output.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not added.done() or added.exception() is None:
                self._send(("abort", request_id))

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str | None = None,
                     priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's embedding (it arrives whole, in one output); cancelling aborts the request."""
        async with aclosing(self.generate(prompt, pooling_params, request_id, priority)) as outputs:
            return await anext(outputs)

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _publish(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, priority, added = command
                try:
                    self.engine.add_request(request_id, prompt, params, priority=priority)
                    added.set_result(None)
                except (ValueError, TypeError) as exc:
                    added.set_exception(exc)
            else:
                self.engine.abort_request([command[1]])

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failing step fails its requests, the engine keeps serving
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                self._publish(output.request_id, output)

    def _fail_all(self, exc: Exception) -> None:
        ids = self.engine.unfinished_request_ids()
        self.engine.abort_request(ids)
        for request_id in ids:
            self._publish(request_id, RuntimeError(f"request {request_id} failed inside the engine: {exc}"))


def _delta(output: RequestOutput, sent: dict[int, tuple[int, int]]) -> RequestOutput:
    """Trim each completion to the text and tokens not yet yielded."""
    outputs = []
    for c in output.outputs:
        text_len, tok_len = sent.get(c.index, (0, 0))
        sent[c.index] = (len(c.text), len(c.token_ids))
        outputs.append(CompletionOutput(
            index=c.index, text=c.text[text_len:], token_ids=c.token_ids[tok_len:],
            cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs[tok_len:] if c.logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return RequestOutput(request_id=output.request_id, prompt=output.prompt, prompt_token_ids=output.prompt_token_ids,
                         prompt_logprobs=output.prompt_logprobs, outputs=outputs, finished=output.finished,
                         num_cached_tokens=output.num_cached_tokens, metrics=output.metrics, error=output.error)
