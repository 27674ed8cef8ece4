"""AsyncLLM: the engine loop in one background thread, outputs fanned out to per-request asyncio queues.

The thread owns the LLMEngine; callers only enqueue commands (add, abort), so no engine state is
shared across threads, and the thread never touches a caller's future: everything it tells a caller
(an output, a refusal, a failure) goes into that caller's stream queue, so a caller that has gone away
(a client disconnect cancels it) cannot break it.

Failures are attributed to the requests they concern and fail only them: a refused request gets its
ValueError, one whose command handling raised gets a RuntimeError naming it, and a request that fails
inside a step finishes with finish_reason "error" and `error` naming it (see EngineCore.step for how a
step's failure is attributed). Anything else that escapes the loop is a bug: the loop is dead, every
waiting and new request fails at once with EngineDeadError naming the cause, and `errored` turns true
so that the server answers 503 and exits for its supervisor to restart it (as vLLM does when its engine
core dies).

The loop detokenizes only requests with stop strings (their stop pass reads text); `generate` makes the
others' text as their outputs are read (engine/stream_text.py), overlapping the next step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from vllmpy.config import EngineConfig
from vllmpy.engine.llm_engine import EngineStats, LLMEngine, PromptType
from vllmpy.engine.stream_text import StreamText, needs_engine_text
from vllmpy.lora.request import LoRARequest
from vllmpy.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams

logger = logging.getLogger("vllmpy")
_Item = RequestOutput | EmbeddingRequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop has died: nothing can be served until the process is restarted."""


@dataclass(frozen=True)
class AddCommand:
    """Queue a request (the engine validates it: a refusal comes back on the request's stream)."""

    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    lora_request: LoRARequest | None = None


@dataclass(frozen=True)
class AbortCommand:
    """Forget a request and free its blocks; unknown or finished ids are ignored."""

    request_id: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncLLM:
    # Whether generate() makes the text of requests the engine loop does not detokenize (stream_text.py);
    # off for subclasses whose engines detokenize everything themselves.
    _text_in_caller = False

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.engine.core.detokenize_every_request = False
        self._text_in_caller = True
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[AddCommand | AbortCommand] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._death: str | None = None  # what killed the loop, once it has died
        self._thread = threading.Thread(target=self._loop, name="vllmpy-engine", daemon=True)
        self._thread.start()

    @property
    def errored(self) -> bool:
        return self._death is not None

    @property
    def death(self) -> str | None:
        """Why the engine loop died (None while it runs)."""
        return self._death

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the loop after its current step; False if that step is still running after `timeout` s."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | PoolingParams,
                       request_id: str | None = None, priority: int = 0, delta: bool = False,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Yield outputs until finished: cumulative, or only what is new since the last yield (delta).

        Leaving the iteration early (a client disconnect cancels it) aborts the request and frees its
        KV blocks, even while its add is still queued: the abort is queued behind it.
        """
        request_id = request_id or f"req-{self.engine.new_request_id()}"
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream  # before the check: a loop dying now still sees this stream
        text = StreamText(self.tokenizer, sampling_params.skip_special_tokens) if self._text_in_caller and \
            isinstance(sampling_params, SamplingParams) and not needs_engine_text(sampling_params) else None
        finished = False
        try:
            if self._death is not None:
                raise EngineDeadError(self._death)
            self._send(AddCommand(request_id, prompt, sampling_params, priority, lora_request))
            sent: dict[int, tuple[int, int]] = {}
            while True:
                output = await stream.queue.get()
                if isinstance(output, BaseException):
                    raise output  # the engine's ValueError for a bad request, or a failure naming it
                finished = output.finished
                if text is not None:
                    output = text.fill(output)
                yield _delta(output, sent) if delta else output
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # a no-op for a request the engine refused or already forgot
                self._send(AbortCommand(request_id))

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str | None = None,
                     priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's embedding (it arrives whole, in one output); cancelling aborts the request."""
        async with aclosing(self.generate(prompt, pooling_params, request_id, priority)) as outputs:
            return await anext(outputs)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter (vLLM's AsyncLLM.add_lora). It runs beside the loop thread: the adapter
        cache it fills is locked, and the engine's slots are written only by the loop."""
        return await asyncio.to_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def abort(self, request_id: str) -> None:
        self._send(AbortCommand(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def info_metrics(self) -> dict[str, dict[str, str]]:
        """The engine's configuration as /metrics info-gauge labels (DPAsyncLLM's come from its engine 0)."""
        from vllmpy.entrypoints.bench.header import info_metrics

        return info_metrics(self.engine.core)

    def _send(self, command: AddCommand | AbortCommand) -> None:
        self._commands.put(command)
        self._wake.set()

    def _publish(self, request_id: str, item: RequestOutput | EmbeddingRequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            pass

    def _publish_step(self, outputs: list[_Item]) -> None:
        """A step's outputs with one wake-up per caller loop, not one per output (each wake-up is a
        self-pipe write and a pass of that loop, taken while the next step wants the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, _Item]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(command)
            except (ValueError, TypeError) as exc:  # refused: the client's to fix
                self._publish(command.request_id, exc)
            except Exception as exc:
                logger.exception("%s of request %s failed", type(command).__name__, command.request_id)
                self._publish(command.request_id, RuntimeError(
                    f"request {command.request_id} failed inside the engine: {type(exc).__name__}: {exc}"))
                self.engine.abort_request([command.request_id])  # whatever part of it got in

    def _handle(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AddCommand):
            self.engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority,
                                    lora_request=command.lora_request)
        else:
            self.engine.abort_request([command.request_id])

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._publish_step(self.engine.step())
        except BaseException as exc:  # a failure no request could be blamed for: the engine is unusable
            logger.critical("the engine loop died", exc_info=exc)
            self._die(f"the engine loop died: {type(exc).__name__}: {exc}")

    def _die(self, cause: str) -> None:
        """Fail every waiting request with `cause`; `generate` refuses new ones with it from now on."""
        self._death = cause
        for request_id in list(self._streams):
            self._publish(request_id, EngineDeadError(cause))


def _deliver(items: list[tuple[asyncio.Queue, _Item]]) -> None:
    for stream_queue, output in items:
        stream_queue.put_nowait(output)


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
