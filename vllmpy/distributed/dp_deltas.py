"""What a data-parallel engine sends per step: each request's output as the part new since its last one.

An engine's RequestOutputs are cumulative (every token, logprob and the text so far), so sending them whole
each step costs O(n) bytes per step and O(n²) over a long output, pickled on the engine's thread. The
engine's OutputEncoder sends only what changed: new tokens, logprobs and text, the prompt once, prompt
logprobs when they changed (they grow only during prefill); the frontend's OutputDecoder rebuilds the
cumulative outputs, so AsyncLLM's streams (cumulative or delta) see what an in-process engine gives.

Tokens and logprobs only grow; so does the text (the output processor holds back a tail that could turn
into a stop string), but a delta still says where its text starts, so a shorter text would arrive exact.
Both ends forget a request once it finishes or is aborted; the decoder rebuilds only requests it was told
to expect, so an output that crosses an abort on the pipe is dropped instead of kept forever.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from vllmpy.outputs import CompletionOutput, EmbeddingRequestOutput, PositionLogprobs, RequestMetrics, RequestOutput


@dataclass(frozen=True)
class CompletionDelta:
    index: int
    text_start: int  # the text keeps its first text_start characters, then `text` follows
    text: str
    token_start: int  # likewise for token_ids and logprobs (the tokens sent so far, unless they shrank)
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None
    error: str | None
    extra: dict
    prompt: tuple[str | None, list[int]] | None  # (prompt, prompt_token_ids) in a request's first delta only
    prompt_logprobs: list | None  # the whole list when it changed since the last delta, else None
    prompt_logprobs_changed: bool


@dataclass
class _Sent:
    """What the encoder has sent of one request (what the frontend now holds): per completion index, (text,
    token count), and the prompt logprobs list (the output processor's object) with its length then."""

    completions: dict[int, tuple[str, int]]
    prompt_logprobs: tuple[object, int]


class OutputEncoder:
    """The engine's side: one per engine process, used by its serving thread only."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: RequestOutput | EmbeddingRequestOutput) -> OutputDelta | EmbeddingRequestOutput:
        if isinstance(output, EmbeddingRequestOutput):  # whole in one output
            return output
        sent = self._sent.get(output.request_id)
        first = sent is None
        if first:
            sent = self._sent[output.request_id] = _Sent({}, (None, 0))
        deltas = []
        for c in output.outputs:
            text, num_tokens = sent.completions.get(c.index, ("", 0))
            text_start = len(text) if c.text.startswith(text) else _common_prefix(text, c.text)
            token_start = num_tokens if len(c.token_ids) >= num_tokens else 0
            deltas.append(CompletionDelta(
                c.index, text_start, c.text[text_start:], token_start, c.token_ids[token_start:],
                None if c.logprobs is None else c.logprobs[token_start:], c.cumulative_logprob, c.finish_reason,
                c.stop_reason))
            sent.completions[c.index] = (c.text, len(c.token_ids))
        logprobs = output.prompt_logprobs  # the output processor's own list: compared by identity and length
        last, last_len = sent.prompt_logprobs
        changed = logprobs is not last or len(logprobs or ()) != last_len
        sent.prompt_logprobs = (logprobs, len(logprobs or ()))
        if output.finished:
            self.forget(output.request_id)
        return OutputDelta(output.request_id, deltas, output.finished, output.num_cached_tokens, output.metrics,
                           output.error, output.extra, (output.prompt, output.prompt_token_ids) if first else None,
                           list(logprobs) if changed and logprobs is not None else None, changed)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDecoder:
    """The frontend's side: one per engine; `expect` / `forget` come from the event loop, `decode` from the
    engine's reader thread."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput | None] = {}  # None: expected, nothing received yet
        self._lock = threading.Lock()

    def expect(self, request_id: str) -> None:
        with self._lock:
            self._outputs[request_id] = None

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._outputs.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._outputs.clear()

    def decode(self, delta: OutputDelta | EmbeddingRequestOutput) -> RequestOutput | EmbeddingRequestOutput | None:
        """The cumulative output (a snapshot of its own), or None for a request no longer expected."""
        with self._lock:
            if delta.request_id not in self._outputs:
                return None
            if isinstance(delta, EmbeddingRequestOutput):
                del self._outputs[delta.request_id]
                return delta
            last = self._outputs[delta.request_id]
            output = _apply(last, delta)
            if delta.finished:
                del self._outputs[delta.request_id]
            else:
                self._outputs[delta.request_id] = output
        return replace(output, outputs=[replace(c, token_ids=list(c.token_ids),
                                                logprobs=None if c.logprobs is None else list(c.logprobs))
                                        for c in output.outputs])


def _apply(last: RequestOutput | None, delta: OutputDelta) -> RequestOutput:
    """`last` extended by `delta`; its lists are extended in place (the caller hands out copies)."""
    if last is None:
        if delta.prompt is None:
            raise ValueError(f"request {delta.request_id}: its first output delta has no prompt")
        prompt, prompt_token_ids = delta.prompt
        last = RequestOutput(delta.request_id, prompt, prompt_token_ids, None, [], False)
    completions = {c.index: c for c in last.outputs}
    for d in delta.outputs:
        c = completions.get(d.index)
        if c is None:
            c = completions[d.index] = CompletionOutput(d.index, "", [], None, None if d.logprobs is None else [])
        del c.token_ids[d.token_start:]
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            del c.logprobs[d.token_start:]
            c.logprobs.extend(d.logprobs)
        c.text = c.text[:d.text_start] + d.text
        c.cumulative_logprob, c.finish_reason, c.stop_reason = d.cumulative_logprob, d.finish_reason, d.stop_reason
    return replace(last, outputs=sorted(completions.values(), key=lambda c: c.index),
                   prompt_logprobs=delta.prompt_logprobs if delta.prompt_logprobs_changed else last.prompt_logprobs,
                   finished=delta.finished, num_cached_tokens=delta.num_cached_tokens, metrics=delta.metrics,
                   error=delta.error, extra=delta.extra)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
