"""Prometheus metrics under vLLM's names with a ``kiln:`` prefix, plus kiln's
own startup facts. Request latencies are observed by the handlers as requests
finish; the engine's gauges and counters are read from its latest stats at
scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiln.engine.outputs import EngineStats
from kiln.entrypoints.async_engine import RequestTimes

__all__ = ["ServerMetrics"]

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector(Collector):
    """Gauges and counters the engine keeps, read at scrape time."""

    def __init__(self, model: str, stats: Callable[[], EngineStats | None],
                 report: Callable[[], dict[str, Any]]) -> None:
        self.model = model
        self.stats = stats
        self.report = report

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        if stats is None:
            return
        yield from self._background(self.report().get("background_compile"))
        for name, doc, value in (
            ("kiln:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("kiln:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kiln:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model], value)
            yield g
        g = GaugeMetricFamily("kiln:execution_info", "What the steps run now (value 1): eager or compiled, and "
                              "the background compile's state (off, building, loading, ready, swapped, failed).",
                              labels=["model_name", "execution", "background_compile"])
        g.add_metric([self.model, stats.execution, stats.background_compile], 1)
        yield g
        for name, doc, value in (
            ("kiln:num_preemptions", "Requests preempted (recomputed later).", stats.num_preemptions),
            ("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("kiln:spec_decode_num_draft_tokens", "Draft tokens run (speculative decoding).", stats.num_draft_tokens),
            ("kiln:spec_decode_num_accepted_tokens", "Draft tokens the model agreed with.",
             stats.num_accepted_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model], value)
            yield c

    def _background(self, build: dict[str, Any] | None) -> Iterator[Any]:
        """A background compile's seconds: how long the build took, when the
        compiled pieces were swapped in (from the start of loading)."""
        for name, doc, key in (
            ("kiln:background_compile_build_seconds", "Seconds the background compile took.", "build_seconds"),
            ("kiln:background_compile_swapped_at_seconds", "When the compiled pieces were swapped in, in seconds "
             "after loading started.", "swapped_at_seconds"),
        ):
            if build is not None and build.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=["model_name"])
                g.add_metric([self.model], build[key])
                yield g


class ServerMetrics:
    def __init__(self, model: str, stats: Callable[[], EngineStats | None],
                 report: Callable[[], dict[str, Any]] = dict) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Time to the first output token.", labels,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("kiln:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                               buckets=_LATENCY, registry=r)
        self.prompt_hist = Histogram("kiln:request_prompt_tokens", "Prompt tokens per request.", labels,
                                     buckets=_TOKENS, registry=r)
        self.gen_hist = Histogram("kiln:request_generation_tokens", "Output tokens per request.", labels,
                                  buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter("kiln:generation_tokens", "Output tokens of finished requests.", labels,
                                         registry=r)
        self.success = Counter("kiln:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.startup = Gauge("kiln:startup_phase_seconds", "Seconds per startup phase.", labels + ["phase"],
                             registry=r)
        self.startup_info = Gauge("kiln:startup_info", "Compile cache state and CUDA graph mode (value 1).",
                                  labels + ["compile_cache", "cudagraph_mode", "optimization_level"], registry=r)
        self.artifacts = Gauge("kiln:artifacts_loaded", "Compiled artifacts loaded at startup.", labels, registry=r)
        r.register(_EngineCollector(model, stats, report))

    def record_startup(self, report: dict[str, Any]) -> None:
        for phase, seconds in report.get("phases", {}).items():
            self.startup.labels(self.model, phase).set(seconds)
        self.startup.labels(self.model, "total").set(report.get("total_seconds", 0.0))
        self.startup_info.labels(self.model, report.get("compile_cache", "off"), report.get("cudagraph_mode", "NONE"),
                                 str(report.get("optimization_level", ""))).set(1)
        self.artifacts.labels(self.model).set(report.get("artifacts_loaded", 0))

    def record_request(self, times: RequestTimes, prompt_tokens: int, output_tokens: int, reason: str) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.prompt_hist.labels(m).observe(prompt_tokens)
        self.gen_hist.labels(m).observe(output_tokens)
        self.success.labels(m, reason).inc()
        if times.scheduled is not None:
            self.queue.labels(m).observe(max(0.0, times.scheduled - times.arrival))
        if times.first_token is not None:
            self.ttft.labels(m).observe(times.first_token - times.arrival)
        for a, b in zip(times.token_times, times.token_times[1:]):
            self.itl.labels(m).observe(b - a)
        if times.finished is not None:
            self.e2e.labels(m).observe(times.finished - times.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
