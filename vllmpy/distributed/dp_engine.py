"""One data-parallel engine process: a whole LLMEngine (EngineCore, and output processing, so the texts
are detokenized here), driven over a multiprocessing Pipe by the server's DPAsyncLLM (dp_client.py).

Everything on the pipe is plain data: the frontend sends AddCommand / AbortCommand (async_llm's), a
LoRACall, or None to stop; the engine answers Ready (or StartFailed) once, then Outputs after every
step (each request's part new since its last output, dp_deltas.py) and after commands that changed its
state while it was idle, a Refusal for a request it would not queue, and a LoRAReply. A failure no
request can be blamed for ends the process: the frontend sees the pipe close and fails only this engine's
requests.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from vllmpy.config import EngineConfig
from vllmpy.distributed.cpu_binding import bind_rank
from vllmpy.distributed.dp_deltas import OutputDelta, OutputEncoder
from vllmpy.engine.async_llm import AbortCommand, AddCommand
from vllmpy.engine.llm_engine import EngineStats, LLMEngine
from vllmpy.outputs import EmbeddingRequestOutput
from vllmpy.sampling_params import SamplingParams

logger = logging.getLogger("vllmpy")
# Seconds an idle engine waits for a command before looking again (the pipe wakes it at once).
_IDLE_POLL_S = 1.0


@dataclass(frozen=True)
class EngineFacts:
    """What the frontend needs to serve without a model of its own: limits, the sizes routing uses, the
    /metrics info labels (measured here, where the engine runs)."""

    pid: int
    max_model_len: int
    vocab_size: int
    task: str
    config: EngineConfig  # after the KV pool was fitted (max_num_seqs may have shrunk)
    num_blocks: int
    default_sampling_params: SamplingParams
    info_metrics: dict[str, dict[str, str]]
    multimodal: bool


@dataclass(frozen=True)
class Ready:
    facts: EngineFacts
    stats: EngineStats


@dataclass(frozen=True)
class StartFailed:
    client_error: bool  # a ValueError (a flag or checkpoint the user must change)
    message: str


@dataclass(frozen=True)
class Outputs:
    """A step's outputs (none: commands changed an idle engine's state), and the stats after it."""

    outputs: list[OutputDelta | EmbeddingRequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class Refusal:
    request_id: str
    client_error: bool  # True: a ValueError / TypeError (400); False: a failure inside the engine
    message: str


@dataclass(frozen=True)
class LoRACall:
    call_id: int
    method: str  # "add_lora" | "remove_lora"
    argument: Any


@dataclass(frozen=True)
class LoRAReply:
    call_id: int
    value: Any
    error: str | None  # a refusal's message


def run_engine(index: int, dp_size: int, config: EngineConfig, conn: Connection) -> None:
    """The process's main: pin to this engine's cores, build the engine, serve the pipe until told to stop
    or the frontend is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group: the server stops its engines
        signal.signal(sig, signal.SIG_IGN)    # after its grace period (or they leave when its pipe closes)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [dp engine {index}] %(message)s")
    bind_rank(index, dp_size)
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        conn.send(StartFailed(isinstance(exc, ValueError), str(exc)))
        return
    conn.send(Ready(_facts(engine), engine.stats()))
    try:
        _serve(engine, conn)
    except (EOFError, BrokenPipeError):  # the frontend is gone: nobody to serve
        pass
    engine.core.shutdown()
    # Leave without interpreter teardown (freeing torch takes seconds on a busy host, past the server's
    # shutdown promise); nothing is left to flush but the log.
    sys.stderr.flush()
    os._exit(0)


def _facts(engine: LLMEngine) -> EngineFacts:
    from vllmpy.entrypoints.bench.header import info_metrics

    core = engine.core
    return EngineFacts(os.getpid(), core.max_model_len, core.vocab_size, core.task, core.config, core.num_blocks,
                       engine.default_sampling_params, info_metrics(core), core.mm_processor is not None)


def _serve(engine: LLMEngine, conn: Connection) -> None:
    encoder = OutputEncoder()
    while True:
        busy = engine.has_unfinished_requests()
        changed = False
        if conn.poll(0 if busy else _IDLE_POLL_S):
            while conn.poll():
                message = conn.recv()
                if message is None:
                    return
                reply = _handle(engine, encoder, message)
                if reply is not None:
                    conn.send(reply)
                changed = True
        if engine.has_unfinished_requests():
            outputs = engine.step()
            conn.send(Outputs([encoder.encode(output) for output in outputs], engine.stats()))
        elif changed:
            conn.send(Outputs([], engine.stats()))


def _handle(engine: LLMEngine, encoder: OutputEncoder, message: AddCommand | AbortCommand | LoRACall
            ) -> Refusal | LoRAReply | None:
    if isinstance(message, LoRACall):
        try:
            return LoRAReply(message.call_id, getattr(engine, message.method)(message.argument), None)
        except ValueError as exc:
            return LoRAReply(message.call_id, None, str(exc))
    if isinstance(message, AbortCommand):
        engine.abort_request([message.request_id])
        encoder.forget(message.request_id)
        return None
    try:
        engine.add_request(message.request_id, message.prompt, message.params, priority=message.priority,
                           lora_request=message.lora_request)
    except (ValueError, TypeError) as exc:  # refused: the client's to fix
        return Refusal(message.request_id, True, str(exc))
    except Exception as exc:
        logger.exception("adding request %s failed", message.request_id)
        engine.abort_request([message.request_id])  # whatever part of it got in
        return Refusal(message.request_id, False,
                       f"request {message.request_id} failed inside the engine: {type(exc).__name__}: {exc}")
    return None
