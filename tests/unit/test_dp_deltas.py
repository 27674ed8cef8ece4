"""Data-parallel output deltas (distributed/dp_deltas.py): random cumulative outputs of several requests
(n = 1 or 2, logprobs or none, prompt logprobs growing over prefill chunks and reset by a preemption, a
text that once shrinks) sent through the encoder, a pickle and the decoder come back equal to what the
engine made, step by step, each a snapshot of its own; a long output's step costs bytes for its new tokens
only (its prompt and prompt logprobs are sent once); forgotten and unexpected requests are dropped."""
from __future__ import annotations

import copy
import pickle
import random

import pytest

from vllmpy.distributed.dp_deltas import OutputDecoder, OutputEncoder
from vllmpy.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def _position(rng: random.Random) -> dict[int, Logprob]:
    return {rng.randrange(1000): Logprob(-rng.random(), 1, None)}


class _FakeRequest:
    """One request's cumulative output as an engine grows it, step by step."""

    def __init__(self, request_id: str, rng: random.Random) -> None:
        self.rng = rng
        n = rng.choice([1, 2])
        with_logprobs = rng.random() < 0.5
        self.output = RequestOutput(
            request_id, f"prompt {request_id}", [rng.randrange(1000) for _ in range(rng.randrange(1, 40))],
            [] if rng.random() < 0.5 else None,
            [CompletionOutput(i, "", [], 0.0 if with_logprobs else None, [] if with_logprobs else None)
             for i in range(n)], False, metrics=RequestMetrics(arrival_time=1.0))
        self.steps = rng.randrange(1, 30)

    def step(self) -> RequestOutput:
        rng, out = self.rng, self.output
        self.steps -= 1
        if out.prompt_logprobs is not None and rng.random() < 0.3:
            if rng.random() < 0.2:
                out.prompt_logprobs = []  # recomputed from position 0 (a preemption): a new list
            out.prompt_logprobs.extend(_position(rng) for _ in range(rng.randrange(1, 4)))
        for c in out.outputs:
            if c.finish_reason is not None:
                continue
            new = [rng.randrange(1000) for _ in range(rng.choice([0, 1, 1, 3]))]
            c.token_ids = c.token_ids + new
            if c.logprobs is not None:
                c.logprobs = c.logprobs + [_position(rng) for _ in new]
                c.cumulative_logprob -= len(new)
            c.text += "".join(f" t{t}" for t in new)
            if rng.random() < 0.05 and c.text:
                c.text = c.text[:-1]  # a held-back tail retracted
            if self.steps <= 0:
                c.finish_reason, c.stop_reason = "length", None
        out.finished = self.steps <= 0
        out.num_cached_tokens = rng.randrange(3)
        out.metrics = RequestMetrics(arrival_time=1.0, num_generation_tokens=len(out.outputs[0].token_ids))
        snapshot = copy.deepcopy(out)  # a snapshot, as the output processor hands out, but for the prompt
        snapshot.prompt_logprobs = out.prompt_logprobs  # logprobs: its own list, shared by every output
        return snapshot


@pytest.mark.parametrize("seed", range(4))
def test_deltas_rebuild_every_cumulative_output(seed: int) -> None:
    rng = random.Random(seed)
    encoder, decoder = OutputEncoder(), OutputDecoder()
    live = {str(i): _FakeRequest(str(i), rng) for i in range(6)}
    for request_id in live:
        decoder.expect(request_id)
    received: list[tuple[RequestOutput, RequestOutput]] = []
    while live:
        batch = [request.step() for request in live.values()]
        deltas = pickle.loads(pickle.dumps([encoder.encode(output) for output in batch]))
        for sent, delta in zip(batch, deltas):
            got = decoder.decode(delta)
            assert got == sent, sent.request_id
            received.append((got, copy.deepcopy(got)))
            if sent.finished:
                del live[sent.request_id]
    for got, at_the_time in received:  # later steps did not change an output already handed out
        assert got == at_the_time


def test_a_long_outputs_step_sends_only_its_new_tokens() -> None:
    encoder = OutputEncoder()
    prompt = list(range(500))
    prompt_logprobs = [None] + [{t: Logprob(-1.0, 1, None)} for t in prompt[1:]]  # the engine's one list
    tokens: list[int] = []
    logprobs: list[dict[int, Logprob]] = []
    for step in range(2000):
        tokens.append(step % 1000)
        logprobs.append({step % 1000: Logprob(-0.5, 1, None)})
        output = RequestOutput("r", "p", prompt, prompt_logprobs,
                               [CompletionOutput(0, " x" * len(tokens), list(tokens), -1.0, list(logprobs))], False)
        delta_bytes = len(pickle.dumps(encoder.encode(output)))
    whole_bytes = len(pickle.dumps(output))
    assert delta_bytes * 50 < whole_bytes, (delta_bytes, whole_bytes)
    assert delta_bytes < 1000


def test_forgotten_and_unexpected_requests_are_dropped() -> None:
    encoder, decoder = OutputEncoder(), OutputDecoder()

    def output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id, None, [1, 2], None, [CompletionOutput(0, "", tokens, None, None)], finished)

    assert decoder.decode(encoder.encode(output("never-sent", [5]))) is None
    decoder.expect("a")
    assert decoder.decode(encoder.encode(output("a", [5]))).outputs[0].token_ids == [5]
    decoder.forget("a")  # aborted by the client: the step already on the pipe is dropped
    assert decoder.decode(encoder.encode(output("a", [5, 6]))) is None
    encoder.forget("a")
    decoder.expect("b")
    assert decoder.decode(encoder.encode(output("b", [7], finished=True))).finished
    assert decoder.decode(encoder.encode(output("b", [7, 8]))) is None  # finished: forgotten at both ends
    encoder.encode(output("c", [1]))  # a first delta the decoder never saw: an invariant broken, said so
    decoder.expect("c")
    with pytest.raises(ValueError, match="request c: its first output delta has no prompt"):
        decoder.decode(encoder.encode(output("c", [1, 2])))
