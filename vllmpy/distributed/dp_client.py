"""DPAsyncLLM: `--data-parallel-size N` behind one server. N engine processes (dp_engine.py, spawned, each
a whole engine and itself tensor parallel when asked) serve the requests one AsyncLLM would; the server's
routes call it exactly as they call AsyncLLM.

It is an AsyncLLM whose engine loop lives in the engine processes: `generate` / `encode` / `abort` and the
per-request streams are AsyncLLM's own, `_send` routes a request to an engine (dp_router.py's rule) and
one reader thread per engine publishes what that engine answers. `engine` is a frontend view of the
engines (_FrontendEngine): the checkpoint's config and tokenizer, opened here without weights (the routes
tokenize and render chat templates here, and send token ids), and engine 0's limits.

Failure isolation: an engine process that dies (its pipe closes) fails only the requests placed on it,
with an error naming the engine, is logged and exported as vllmpy:data_parallel_engine_up 0; the others
go on serving and new requests route around it. Only when every engine is dead does `errored` turn true
(the server then answers 503 and exits, as with one engine).
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from vllmpy.config import EngineConfig
from vllmpy.distributed.dp_deltas import OutputDecoder
from vllmpy.distributed.dp_engine import (
    EngineFacts,
    LoRACall,
    LoRAReply,
    Outputs,
    Ready,
    Refusal,
    StartFailed,
    run_engine,
)
from vllmpy.distributed.dp_router import PrefixAffinityRouter
from vllmpy.engine.async_llm import AbortCommand, AddCommand, AsyncLLM, EngineDeadError
from vllmpy.engine.llm_engine import EngineStats, PromptType
from vllmpy.loader.model_loader import Checkpoint, open_checkpoint
from vllmpy.lora.request import LoRARequest

logger = logging.getLogger("vllmpy")
# Seconds the engines get to leave after the stop message before they are killed (a step cannot be cut).
_STOP_TIMEOUT_S = 10.0


class EngineProcessDiedError(RuntimeError):
    """The data-parallel engine a request was on has died (the other engines go on serving)."""


def start_async_engine(config: EngineConfig) -> AsyncLLM:
    """One in-process engine, or DPAsyncLLM at --data-parallel-size > 1."""
    return DPAsyncLLM(config) if config.parallel.data_parallel_size > 1 else AsyncLLM(config)


class _EngineProcess:
    """One engine process, its pipe, and a sender thread (a send never blocks the server's event loop
    behind an engine busy in a step)."""

    def __init__(self, index: int, dp_size: int, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")  # no forked torch / OpenMP state
        self.index = index
        self.conn, child = context.Pipe()
        # Not a daemon: a daemonic process may not spawn its own tensor-parallel workers.
        self.process = context.Process(target=run_engine, args=(index, dp_size, config, child),
                                       name=f"vllmpy-dp-engine{index}")
        self.process.start()
        child.close()
        self.facts: EngineFacts | None = None
        self.stats: EngineStats | None = None
        self.death: str | None = None
        self.decoder = OutputDecoder()  # rebuilds its cumulative outputs from the deltas it sends
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self) -> EngineFacts:
        """The engine's facts once it has loaded; a failed start raises naming the engine."""
        try:
            message = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"data parallel engine {self.index} (pid {self.pid}) exited while starting "
                               f"(exit code {self.process.exitcode})") from None
        if isinstance(message, StartFailed):
            raise (ValueError if message.client_error else RuntimeError)(
                f"data parallel engine {self.index}: {message.message}")
        assert isinstance(message, Ready)
        self.facts, self.stats = message.facts, message.stats
        threading.Thread(target=self._send_loop, name=f"vllmpy-dp-send{self.index}", daemon=True).start()
        return self.facts

    def send(self, message: Any) -> None:
        """Pickled here, so that what cannot be sent fails its caller (the request it belongs to)."""
        self._outbox.put((bytes(ForkingPickler.dumps(message)), message is None))

    def _send_loop(self) -> None:
        while True:
            payload, last = self._outbox.get()
            try:
                self.conn.send_bytes(payload)
            except OSError:  # the engine is gone; its reader reports the death
                return
            if last:
                return


@dataclasses.dataclass
class _Call:
    engine: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    value: Any = None
    error: str | None = None


class DPAsyncLLM(AsyncLLM):
    def __init__(self, config: EngineConfig) -> None:  # no AsyncLLM.__init__: the engines run elsewhere
        size = config.parallel.data_parallel_size
        one = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_size=1))
        self._engines = [_EngineProcess(i, size, one) for i in range(size)]
        self._stopped = False
        atexit.register(self.shutdown)  # a server's exit leaves no engine behind
        try:
            checkpoint = open_checkpoint(config.model)  # the tokenizer and config, while the engines load
            facts = [engine.wait_ready() for engine in self._engines]
        except BaseException:
            self.shutdown(timeout=0)
            raise
        if facts[0].multimodal:
            self.shutdown(timeout=0)
            raise ValueError(f"--data-parallel-size {size}: image models are not served with data parallel yet "
                             f"(the server would need the model's image processor); use --data-parallel-size 1")
        for engine in self._engines:
            logger.info("data parallel engine %d: pid %d, %d KV blocks", engine.index, engine.pid,
                        engine.facts.num_blocks)
        self.engine = _FrontendEngine(checkpoint, facts[0], self._call_all)
        self.tokenizer = checkpoint.tokenizer
        self._streams = {}
        self._death: str | None = None
        self._router = PrefixAffinityRouter([f.num_blocks for f in facts], facts[0].config.cache.block_size)
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        for engine in self._engines:
            threading.Thread(target=self._read, args=(engine,), name=f"vllmpy-dp-read{engine.index}",
                             daemon=True).start()

    def shutdown(self, timeout: float = _STOP_TIMEOUT_S) -> bool:
        """Stop every engine after its current step; kill those still running after `timeout` s (False then)."""
        if self._stopped and all(not e.process.is_alive() for e in self._engines):
            return True
        self._stopped = True
        for engine in self._engines:
            engine.send(None)
        deadline = time.monotonic() + timeout
        for engine in self._engines:
            engine.process.join(max(0.0, deadline - time.monotonic()))
        stopped = all(not engine.process.is_alive() for engine in self._engines)
        for engine in self._engines:
            if engine.process.is_alive():
                engine.process.kill()
                engine.process.join()
        return stopped

    def stats(self) -> list[EngineStats]:
        """Each engine's latest report (a dead engine keeps its totals, with nothing running or waiting):
        /metrics exports them with an `engine` label and summed."""
        return [engine.stats if engine.death is None else dataclasses.replace(
            engine.stats, num_running=0, num_waiting=0, kv_cache_usage=0.0) for engine in self._engines]

    def info_metrics(self) -> dict[str, dict[str, str]]:
        return self._engines[0].facts.info_metrics

    def export_metrics(self, registry: CollectorRegistry) -> None:
        """vllmpy:data_parallel_engine_up{engine, pid}: 1 while that engine serves, 0 once it has died."""
        registry.register(_EngineUpCollector(self._engines))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await asyncio.to_thread(self.engine.remove_lora, lora_int_id)

    def _send(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
            index = self._router.release(command.request_id)
            if index is not None:
                self._engines[index].decoder.forget(command.request_id)
                self._engines[index].send(command)
            return
        lora = command.lora_request
        try:
            index = self._router.place(command.request_id, _prompt_token_ids(command.prompt),
                                       getattr(command.params, "n", 1), lora.lora_int_id if lora else 0)
        except LookupError as exc:
            self._publish(command.request_id, EngineDeadError(str(exc)))
            return
        self._engines[index].decoder.expect(command.request_id)
        self._engines[index].send(command)

    def _call_all(self, method: str, argument: Any) -> list[Any]:
        """`method(argument)` on every live engine (LoRA adapters are loaded everywhere); raises the first
        refusal as a ValueError."""
        calls = []
        for engine in self._engines:
            with self._lock:
                if engine.death is not None:
                    continue
                call_id = next(self._call_ids)
                call = self._calls[call_id] = _Call(engine.index)
            calls.append(call)
            engine.send(LoRACall(call_id, method, argument))
        for call in calls:
            call.done.wait()
        error = next((call.error for call in calls if call.error is not None), None)
        if error is not None:
            raise ValueError(error)
        return [call.value for call in calls]

    def _read(self, engine: _EngineProcess) -> None:
        """Publish what `engine` answers, until its pipe closes."""
        while True:
            try:
                message = engine.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, Outputs):
                engine.stats = message.stats
                for output in message.outputs:
                    if output.finished:
                        self._router.release(output.request_id)
                self._publish_step([output for delta in message.outputs
                                    if (output := engine.decoder.decode(delta)) is not None])
            elif isinstance(message, Refusal):
                self._router.release(message.request_id)
                engine.decoder.forget(message.request_id)
                self._publish(message.request_id,
                              (ValueError if message.client_error else RuntimeError)(message.message))
            elif isinstance(message, LoRAReply):
                with self._lock:
                    call = self._calls.pop(message.call_id)
                call.value, call.error = message.value, message.error
                call.done.set()
        if not self._stopped:
            self._engine_died(engine)

    def _engine_died(self, engine: _EngineProcess) -> None:
        engine.process.join(5)
        cause = f"data parallel engine {engine.index} (pid {engine.pid}) died (exit code {engine.process.exitcode})"
        with self._lock:
            engine.death = cause
            orphaned = [call for call in self._calls.values() if call.engine == engine.index]
        lost = self._router.mark_dead(engine.index)
        engine.decoder.clear()
        logger.error("%s; failing its %d in-flight requests, serving on the other engines", cause, len(lost))
        for request_id in lost:
            self._publish(request_id, EngineProcessDiedError(f"{cause} while serving request {request_id}"))
        for call in orphaned:
            call.error = cause
            call.done.set()
        if all(e.death is not None for e in self._engines):
            self._die("every data parallel engine has died: " + "; ".join(e.death for e in self._engines))


class _FrontendCore:
    """What the routes read from EngineCore, for engines that live in other processes."""

    def __init__(self, checkpoint: Checkpoint, facts: EngineFacts) -> None:
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.task = facts.task
        self.config = facts.config
        self.mm_processor = None  # image models are refused under data parallel

    @property
    def _arch(self) -> str:
        return (self.checkpoint.config.get("architectures") or ["?"])[0]


class _FrontendEngine:
    """What the routes read from LLMEngine; LoRA adapters are loaded on (and removed from) every engine."""

    def __init__(self, checkpoint: Checkpoint, facts: EngineFacts, call_all) -> None:
        self.core = _FrontendCore(checkpoint, facts)
        self.tokenizer = checkpoint.tokenizer
        self.default_sampling_params = facts.default_sampling_params
        self._call_all = call_all
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return all(self._call_all("add_lora", lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._call_all("remove_lora", lora_int_id))


class _EngineUpCollector:
    def __init__(self, engines: list[_EngineProcess]) -> None:
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("vllmpy:data_parallel_engine_up",
                                   "1 while the data parallel engine serves, 0 once its process has died.",
                                   labels=["engine", "pid"])
        for engine in self._engines:
            family.add_metric([str(engine.index), str(engine.pid)], 0 if engine.death is not None else 1)
        yield family


def _prompt_token_ids(prompt: PromptType) -> list[int] | None:
    """The token ids routing hashes: the routes send them (a text prompt is tokenized by its engine)."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return ids if isinstance(ids, list) else None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None
