"""Prometheus metrics with vLLM's names.

Engine state (queues, KV usage, token and prefix-cache totals) is read from EngineStats at every scrape,
so it is the state after the latest engine step. Request latencies are observed as each request's
outputs pass through the server, one output per engine step. Each server owns its registry: no globals.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vllmpy.engine.llm_engine import EngineStats
from vllmpy.outputs import RequestOutput
from vllmpy.spec_decode.drafter import SpecDecodeStats

# vLLM's bucket boundaries, so dashboards built for vLLM read these histograms unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters straight from EngineStats, read when Prometheus scrapes. Data parallel engines
    (a list of EngineStats, one per engine) are exported summed under the usual labels, and each under
    an `engine` label as vLLM does: sum by engine with {engine!=""}, or read the total at {engine=""}."""

    def __init__(self, stats: Callable[[], EngineStats | list[EngineStats]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        reported = self._stats()
        engines = reported if isinstance(reported, list) else []
        s = _sum_stats(engines) if engines else reported
        gauges = (("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
                  ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                   s.kv_cache_usage))
        counters = (("vllm:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
                    ("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total),
                    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
                    ("vllm:num_preemptions", "Preemptions (a request's blocks freed to be recomputed).",
                     s.num_preemptions))
        if s.recurrent_snapshot_slots:  # hybrid models' prefix caching (engine/recurrent_snapshots.py)
            gauges += (("vllm:recurrent_snapshot_slots", "Recurrent-state snapshot slots in the pool.",
                        s.recurrent_snapshot_slots),
                       ("vllm:recurrent_snapshot_bytes", "Bytes of recurrent state held by published snapshots.",
                        s.recurrent_snapshot_bytes))
            counters += (("vllm:recurrent_snapshots_taken", "Recurrent-state snapshots written and published.",
                          s.recurrent_snapshots_taken),
                         ("vllm:recurrent_snapshot_hits", "Admissions that resumed a recurrent-state snapshot.",
                          s.recurrent_snapshot_hits))
        for kind, suffix, rows in ((GaugeMetricFamily, "", gauges), (CounterMetricFamily, "_total", counters)):
            for name, doc, value in rows:
                family = kind(name, doc, labels=["model_name"])
                family.add_metric([self._model_name], value)
                for index, engine in enumerate(engines):
                    family.add_sample(name + suffix, {"model_name": self._model_name, "engine": str(index)},
                                      getattr(engine, _STAT_OF[name]))
                yield family
        if s.spec_decode is not None:
            yield from _spec_decode_counters(s.spec_decode, self._model_name)
        if s.max_loras:  # vLLM's: adapter names as comma-joined labels, the scrape time as the value
            family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                       labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            family.add_metric([str(s.max_loras), ",".join(s.waiting_lora_adapters),
                               ",".join(s.running_lora_adapters)], time.time())
            yield family


# The EngineStats field behind each engine gauge and counter (their per-engine samples).
_STAT_OF = {"vllm:num_requests_running": "num_running", "vllm:num_requests_waiting": "num_waiting",
            "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:prompt_tokens": "prompt_tokens_total",
            "vllm:generation_tokens": "generation_tokens_total", "vllm:prefix_cache_queries": "prefix_cache_queries",
            "vllm:prefix_cache_hits": "prefix_cache_hits", "vllm:num_preemptions": "num_preemptions",
            "vllm:recurrent_snapshot_slots": "recurrent_snapshot_slots",
            "vllm:recurrent_snapshot_bytes": "recurrent_snapshot_bytes",
            "vllm:recurrent_snapshots_taken": "recurrent_snapshots_taken",
            "vllm:recurrent_snapshot_hits": "recurrent_snapshot_hits"}


def _sum_stats(engines: list[EngineStats]) -> EngineStats:
    """The engines' totals, field by field: counts summed, KV usage their mean (each pool is its own
    0..1), adapters' request counts merged, max_loras the same on every engine."""
    total: dict[str, object] = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(e, field.name) for e in engines]
        if field.name == "kv_cache_usage":
            total[field.name] = sum(values) / len(values)
        elif field.name == "max_loras":
            total[field.name] = values[0]
        elif field.name == "spec_decode":
            spec = [v for v in values if v is not None]
            total[field.name] = _sum_spec(spec) if spec else None
        elif isinstance(values[0], dict):
            total[field.name] = _sum_counts(values)
        else:
            total[field.name] = sum(values)
    return EngineStats(**total)


def _sum_spec(stats: list[SpecDecodeStats]) -> SpecDecodeStats:
    width = max(len(s.accepted_per_pos) for s in stats)
    return SpecDecodeStats(sum(s.num_drafts for s in stats), sum(s.num_draft_tokens for s in stats),
                           sum(s.num_accepted_tokens for s in stats),
                           [sum(s.accepted_per_pos[i] for s in stats if i < len(s.accepted_per_pos))
                            for i in range(width)])


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for count in counts:
        for name, value in count.items():
            total[name] = total.get(name, 0) + value
    return total


def _spec_decode_counters(stats: SpecDecodeStats, model_name: str) -> Iterator[Metric]:
    """vLLM's speculative decoding counters (its definitions: spec_decode/drafter.py SpecDecodeStats)."""
    for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "(Request, step) pairs that carried draft tokens.", stats.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens)):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft.", labels=["model_name", "position"])
    for position, value in enumerate(stats.accepted_per_pos):
        family.add_metric([model_name, str(position)], value)
    yield family


class ServerMetrics:
    """One server's metrics: render() for GET /metrics, track() for each request it serves. `info` maps gauge
    names to labels that describe the engine's fixed configuration; each is exported with the value 1
    (Prometheus' info idiom, as vLLM's vllm:cache_config_info) so clients can read how the server runs."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 info: dict[str, dict[str, str]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        for name, labels in (info or {}).items():
            Gauge(name, "Engine configuration, as labels.", list(labels), registry=self.registry).labels(
                **labels).set(1)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Seconds between a request's engine steps "
                             "that produced tokens.", labels, buckets=ITL_BUCKETS,
                             registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Seconds from arrival to the last output.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._model_name = model_name

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_finished(self, finish_reason: str) -> None:
        self._success.labels(self._model_name, finish_reason).inc()

    def track(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observes one request's latencies from the RequestOutputs relayed to its client."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_token_time: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is not None and m.last_token_time is not None and m.last_token_time != self._last_token_time:
            if self._last_token_time is None:
                self._metrics.ttft.observe(m.ttft)
            else:
                self._metrics.itl.observe(m.last_token_time - self._last_token_time)
            self._last_token_time = m.last_token_time
        if output.finished and not self._done:
            self._done = True
            if m is not None:
                self._metrics.e2e.observe((m.finished_time or time.time()) - m.arrival_time)
            for completion in output.outputs:
                self._metrics.count_finished(completion.finish_reason or "abort")

    def close(self) -> None:
        """The client left (or the server stopped) before the request finished: it was aborted."""
        if not self._done:
            self._done = True
            self._metrics.count_finished("abort")
