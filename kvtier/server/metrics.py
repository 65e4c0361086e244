"""`/metrics` of `kvtier serve`, through prometheus-client: one registry per app.

`ServerMetrics(engine)` owns a `CollectorRegistry` of its own (never the process-global
one, so several apps in one process never clash) holding two kinds of families, every
name prefixed `kvtier_`:

- observed by the server: the latency histograms (time to first token, inter-token,
  end to end: `observe(result)` for each finished `RequestResult`) and the requests
  answered by HTTP status (`count(status)`);
- read at scrape by `EngineCollector`: the engine's running and waiting requests, its
  token and preemption counters (`engine.stats`), the cache's families
  (`engine.cache.metrics`, by tier) and, only where the engine has a storage tier, the
  storage tier's (one `snapshot()` per scrape).

Everything is fixed in size (counters, gauges, fixed-bucket histograms), so a scrape
costs the same however long the server has run. `exposition()` is the text format,
served with `CONTENT_TYPE`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client import Metric

    from kvtier.cache.metrics import Histogram as FixedHistogram
    from kvtier.cache.storage_mover import HostStorageMover
    from kvtier.engine.engine import Engine
    from kvtier.engine.results import RequestResult

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Upper bounds in seconds of the request latency histograms: 1 ms to 10 min.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0, 160.0, 320.0, 600.0,
)  # fmt: skip


class ServerMetrics:
    """The app's registry: latency histograms and request counts, plus the engine's families at scrape."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.ttft = self._histogram("time_to_first_token_seconds", "time from arrival to the first token")
        self.itl = self._histogram("inter_token_latency_seconds", "time between two tokens of a request")
        self.e2e = self._histogram("e2e_request_latency_seconds", "time from arrival to the last token")
        self.requests = Counter(
            "kvtier_requests", "HTTP requests answered, by status", ["status"], registry=self.registry
        )
        self.requests.labels(status="200")  # the family has a sample before the first request
        self.registry.register(EngineCollector(engine))
        self._finished = 0
        self._e2e_sum = 0.0

    def _histogram(self, name: str, help_: str) -> Histogram:
        return Histogram(f"kvtier_{name}", help_, buckets=LATENCY_BUCKETS, registry=self.registry)

    def count(self, status: int | str) -> None:
        """One request answered with HTTP `status`."""
        self.requests.labels(status=str(status)).inc()

    def observe(self, result: RequestResult) -> None:
        """A finished request's latencies: TTFT, each gap between its tokens, end to end."""
        self.ttft.observe(result.ttft_s)
        times = result.token_times
        for a, b in itertools.pairwise(times):
            self.itl.observe(b - a)
        self.e2e.observe(result.total_s)
        self._finished += 1
        self._e2e_sum += result.total_s

    def mean_latency_s(self) -> float | None:
        """The mean end-to-end latency of the requests finished so far; None before the first."""
        return self._e2e_sum / self._finished if self._finished else None

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's, the cache's and the storage tier's families, read at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield _gauge("num_requests_running", "requests holding device slots", engine.num_running)
        yield _gauge("num_requests_waiting", "requests queued in the engine", engine.num_waiting)
        s = engine.stats
        yield _counter("prompt_tokens", "prompt tokens of the requests admitted", s.prompt_tokens)
        yield _counter("generation_tokens", "tokens generated", s.generation_tokens)
        yield _counter("num_preemptions", "running requests preempted under memory pressure", s.preemptions)
        yield _counter(
            "requests_finished", "requests the engine finished, by reason", dict(s.finished), "reason"
        )
        yield from _cache_families(engine)
        if engine.storage is not None:
            yield from _storage_families(engine.storage)


def _cache_families(engine: Engine) -> Iterator[Metric]:
    m, frag = engine.cache.metrics, engine.cache.fragmentation()
    yield _counter("cache_matches", "prefix lookups", m.matches)
    tiers = {"device": m.device_hit_tokens, "host": m.host_hit_tokens, "none": m.miss_tokens}
    if engine.storage is not None:
        tiers["storage"] = m.storage_hit_tokens
    yield _counter("cache_prompt_tokens", "prompt tokens by where they were found", tiers, "tier")
    moved = {"h2d": m.bytes_h2d, "d2h": m.bytes_d2h}
    yield _counter("cache_bytes", "KV bytes moved between tiers", moved, "direction")
    yield _counter("cache_loads", "load backs submitted", m.loads)
    yield _counter("cache_loaded_tokens", "tokens loaded back from the host", m.loaded_tokens)
    yield _histogram("cache_load_seconds", "time from load submission to completion", m.load_seconds)
    gbps = m.bytes_h2d / m.load_seconds.sum / 1e9 if m.load_seconds.sum else 0.0
    yield _gauge("cache_reload_gbps", "reload speed over all loads", gbps)
    evicted = {"device": m.device_evictions, "host": m.host_evictions}
    yield _counter("cache_evictions", "nodes evicted", evicted, "tier")
    yield _counter("cache_backups", "device to host backups started", m.backups)
    for name, help_ in (
        ("free_slots", "free slots per tier"),
        ("free_runs", "free extents per tier (fragmentation)"),
        ("largest_free_run", "largest free extent per tier"),
    ):
        yield _gauge(f"cache_{name}", help_, {t: frag[f"{t}_{name}"] for t in ("device", "host")}, "tier")


def _storage_families(storage: HostStorageMover) -> Iterator[Metric]:
    """The storage tier's families, from one snapshot of its counters."""
    m = storage.metrics.snapshot()
    for name, help_ in (
        ("bytes_read", "value bytes read from storage and verified"),
        ("bytes_written", "value bytes written to storage"),
        ("pages_read", "pages read from storage and verified"),
        ("pages_written", "pages written to storage"),
        ("writes_dropped", "page writes dropped (too many pending)"),
        ("writes_failed", "page writes the backend did not store"),
        ("prefetched_tokens", "tokens prefetched from storage into the host"),
    ):
        yield _counter(f"storage_{name}", help_, m[name])
    yield _counter("storage_errors", "backend calls that failed, by operation", m["errors"], "op")
    yield _counter("storage_rejected", "values read back and refused, by reason", m["rejected"], "reason")
    yield _histogram(
        "storage_prefetch_seconds", "time from a prefetch's start to its end", m["prefetch_seconds"]
    )
    yield _histogram("storage_write_seconds", "time from a store's submission to its end", m["write_seconds"])
    up = storage.backend.reachable()
    yield _gauge("storage_up", "1 while the storage tier answers, 0 while it cannot be reached", int(up))
    usage = storage.backend.usage()
    if usage is not None:
        yield _gauge("storage_stored_pages", "pages the backend holds", usage[0])
        yield _gauge("storage_stored_bytes", "bytes the backend holds", usage[1])


def _family(kind: type, name: str, help_: str, value: float | dict, label: str | None) -> Metric:
    """`value`: one number, or `{label value: number}` under the label `label`."""
    if label is None:
        return kind(f"kvtier_{name}", help_, value=value)
    family = kind(f"kvtier_{name}", help_, labels=[label])
    for key, v in value.items():
        family.add_metric([key], v)
    return family


def _counter(name: str, help_: str, value: float | dict, label: str | None = None) -> Metric:
    """A counter family; prometheus-client appends `_total` to its samples' name."""
    return _family(CounterMetricFamily, name, help_, value, label)


def _gauge(name: str, help_: str, value: float | dict, label: str | None = None) -> Metric:
    return _family(GaugeMetricFamily, name, help_, value, label)


def _histogram(name: str, help_: str, h: FixedHistogram) -> Metric:
    """A fixed-bucket `kvtier.cache.metrics.Histogram` as a histogram family (cumulative buckets)."""
    buckets = [("+Inf" if bound == float("inf") else repr(bound), n) for bound, n in h.cumulative()]
    return HistogramMetricFamily(f"kvtier_{name}", help_, buckets=buckets, sum_value=h.sum)
