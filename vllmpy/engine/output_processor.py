"""Turns engine-core updates into RequestOutputs: text, logprobs, n > 1.

The text is the core's: its stop pass (engine/stop.py) detokenizes each new token to match stop strings,
so each request carries its detokenizer and the cut a stop string made; nothing here stops a request.
Under AsyncLLM only requests with stop strings have a detokenizer: the others' text is "" here and
AsyncLLM.generate makes it (engine/stream_text.py).

Each request is processed under its own guard: an exception fails that user request (all its sequences,
since its response is an error anyway) and the others of the step go on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from vllmpy.engine.fault_injection import FaultInjector
from vllmpy.engine.request import Request
from vllmpy.engine.schedule_types import ModelRunnerOutput, SampledLogprobs
from vllmpy.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from vllmpy.tokenizer import Tokenizer

logger = logging.getLogger("vllmpy")


@dataclass
class SequenceState:
    """One child sequence of a user request."""

    request: Request
    index: int
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    text: str = ""
    num_tokens: int = 0  # output tokens folded in so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, faults: FaultInjector | None = None) -> None:
        self.tokenizer = tokenizer
        self.faults = faults  # test-only (engine/fault_injection.py); None in production
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}
        self._token_text: dict[int, str] = {}
        self.num_generated_tokens = 0  # output tokens the stop pass kept, over every request since start

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> ParentState:
        params = children[0].sampling_params
        sequences = [
            SequenceState(
                request=child, index=i,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i, child in enumerate(children)]
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids, sequences,
                             RequestMetrics(arrival_time=children[0].arrival_time),
                             prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        self.parents[request_id] = parent
        for seq in sequences:
            self.child_to_parent[seq.request.request_id] = (parent, seq)
        return parent

    def decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _position(self, entry: SampledLogprobs) -> PositionLogprobs:
        """vLLM's shape: the chosen token with its rank, then the top-k with ranks 1..k."""
        result: PositionLogprobs = {}
        chosen = entry.token_ids[0]
        result[chosen] = Logprob(entry.logprobs[0], entry.chosen_rank, self.decoded(chosen))
        for rank, (tid, lp) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            if tid not in result:
                result[tid] = Logprob(lp, rank, self.decoded(tid))
        return result

    def process(self, updated: list[Request],
                runner_output: ModelRunnerOutput | None) -> tuple[list[ParentState], list[str]]:
        """Fold this step's updates in; returns the touched parents and the child ids whose parent failed
        here (the core must finish them)."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        failed: list[str] = []
        index = {rid: i for i, rid in enumerate(runner_output.req_ids)} if runner_output else {}
        for request in updated:
            pair = self.child_to_parent.get(request.request_id)
            if pair is None:
                continue
            parent, seq = pair
            touched[parent.request_id] = parent
            try:
                self._update(parent, seq, request, runner_output, index.get(request.request_id), now)
            except Exception as exc:
                logger.exception("processing the output of request %s failed", request.request_id)
                failed += self.fail(parent, f"output processing raised {type(exc).__name__}: {exc}")
            if parent.finished:
                parent.metrics.finished_time = now
        return list(touched.values()), failed

    def _update(self, parent: ParentState, seq: SequenceState, request: Request,
                runner_output: ModelRunnerOutput | None, row: int | None, now: float) -> None:
        """One child's new tokens (those the stop pass kept), logprobs and finish."""
        if self.faults is not None:
            self.faults.check(request.request_id, request.prompt_token_ids)
        if runner_output is not None and parent.prompt_logprobs is not None and seq.index == 0:
            self._add_prompt_logprobs(parent, runner_output.prompt_logprobs.get(request.request_id))
        new = request.num_output_tokens - seq.num_tokens
        if new > 0:
            parent.metrics.first_token_time = parent.metrics.first_token_time or now
            parent.metrics.last_token_time = now
            parent.metrics.num_generation_tokens += new
            self.num_generated_tokens += new
            parent.metrics.num_draft_tokens = sum(s.request.num_draft_tokens for s in parent.sequences)
            parent.metrics.num_accepted_tokens = sum(s.request.num_accepted_tokens for s in parent.sequences)
            seq.num_tokens = request.num_output_tokens
            self._add_text(seq)
            if row is not None:
                self._add_logprobs(seq, (runner_output.logprobs[row] or [])[:new])
        if request.is_finished and seq.finish_reason is None:
            seq.finish_reason = request.status.finish_reason
            seq.stop_reason = request.stop_reason
            seq.error = None if request.error is None else named_error(parent.request_id, request.error)

    def fail(self, parent: ParentState, message: str) -> list[str]:
        """Finish every unfinished sequence of `parent` with `message`; returns their child ids."""
        failed = [s for s in parent.sequences if s.finish_reason is None]
        for seq in failed:
            seq.finish_reason, seq.stop_reason = "error", None
            seq.error = named_error(parent.request_id, message)
        return [s.request.request_id for s in failed]

    def _add_prompt_logprobs(self, parent: ParentState, entries: list[SampledLogprobs | None] | None) -> None:
        if not entries:
            return
        if entries[0] is None:  # (re)computed from position 0, e.g. after preemption
            parent.prompt_logprobs = []
        parent.prompt_logprobs.extend(None if e is None else self._position(e) for e in entries)

    @staticmethod
    def _add_text(seq: SequenceState) -> None:
        request = seq.request
        text = request.detokenizer.output_text if request.detokenizer is not None else ""
        seq.text = text if request.output_text_len is None else text[:request.output_text_len]

    def _add_logprobs(self, seq: SequenceState, entries: list[SampledLogprobs]) -> None:
        """The kept tokens' entries (the stop pass may have dropped the step's later tokens)."""
        if seq.logprobs is None:
            return
        for entry in entries:
            seq.logprobs.append(self._position(entry))
            seq.cumulative_logprob += entry.logprobs[0]

    def visible_text(self, seq: SequenceState) -> str:
        """Hold back a tail that could still grow into a stop string (never shown, then retracted)."""
        stops = seq.request.sampling_params.stop
        if seq.finish_reason is not None or not stops:
            return seq.text
        hold = max(len(s) for s in stops) - 1
        return seq.text[:max(0, len(seq.text) - hold)] if hold else seq.text

    def make_output(self, parent: ParentState) -> RequestOutput:
        """A snapshot: the lists and metrics the engine goes on mutating are copied, since AsyncLLM's caller
        reads an output while later steps run (a shared one would show their tokens and times)."""
        outputs = [CompletionOutput(index=s.index, text=self.visible_text(s),
                                    token_ids=list(s.request.output_token_ids), cumulative_logprob=s.cumulative_logprob,
                                    logprobs=None if s.logprobs is None else list(s.logprobs),
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for s in parent.sequences]
        errors = [s.error for s in parent.sequences if s.error]
        first = parent.sequences[0].request
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
                             outputs=outputs, finished=parent.finished,
                             num_cached_tokens=max(first.num_cached_tokens, 0), metrics=replace(parent.metrics),
                             error=errors[0] if errors else None)

    def remove(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for seq in parent.sequences:
            self.child_to_parent.pop(seq.request.request_id, None)

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent; returns its child ids for the core to free."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self.remove(parent)
        return [s.request.request_id for s in parent.sequences]


def named_error(request_id: str, message: str) -> str:
    """An engine failure as its client sees it: which request, and what went wrong."""
    return f"request {request_id}: {message}"
