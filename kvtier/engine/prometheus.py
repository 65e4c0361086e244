"""`/metrics` of `kvtier serve`: the server's request counters (`Stats`) and the Prometheus text.

`exposition(engine, stats)` renders the cache's counters, the storage tier's (only where the
engine has one) and the server's, every name prefixed `kvtier_`. Everything it reads is
fixed in size (counters and fixed-bucket histograms), so a scrape costs O(buckets) however
long the server has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partialmethod
from typing import TYPE_CHECKING, Any

from kvtier.cache.metrics import Histogram

if TYPE_CHECKING:
    from kvtier.cache.storage_mover import HostStorageMover
    from kvtier.engine.engine import Engine, RequestResult


@dataclass
class Stats:
    """Request counters and fixed-bucket latency histograms for /metrics: fixed in size."""

    requests: dict[str, int] = field(default_factory=dict)  # by HTTP status: a handful of keys
    ttft: Histogram = field(default_factory=Histogram)
    latency: Histogram = field(default_factory=Histogram)

    def count(self, status: str) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1

    def record(self, result: RequestResult) -> None:
        self.count("200")
        self.ttft.observe(result.ttft_s)
        self.latency.observe(result.total_s)


def exposition(engine: Engine, stats: Stats) -> str:
    """The Prometheus text of the cache's counters, the storage tier's and the server's; O(buckets)."""
    m, frag, out = engine.cache.metrics, engine.cache.fragmentation(), _Exposition()
    out.counter("cache_matches_total", "prefix lookups", m.matches)
    tiers = {"device": m.device_hit_tokens, "host": m.host_hit_tokens, "none": m.miss_tokens}
    if engine.storage is not None:
        tiers["storage"] = m.storage_hit_tokens
    out.counter("cache_prompt_tokens_total", "prompt tokens by where they were found", tiers, "tier")
    moved = {"h2d": m.bytes_h2d, "d2h": m.bytes_d2h}
    out.counter("cache_bytes_total", "KV bytes moved between tiers", moved, "direction")
    out.counter("cache_loads_total", "load backs submitted", m.loads)
    out.counter("cache_loaded_tokens_total", "tokens loaded back from the host", m.loaded_tokens)
    out.histogram("cache_load_seconds", "time from load submission to completion", m.load_seconds)
    gbps = m.bytes_h2d / m.load_seconds.sum / 1e9 if m.load_seconds.sum else 0.0
    out.gauge("cache_reload_gbps", "reload speed over all loads", gbps)
    evicted = {"device": m.device_evictions, "host": m.host_evictions}
    out.counter("cache_evictions_total", "nodes evicted", evicted, "tier")
    out.counter("cache_backups_total", "device to host backups started", m.backups)
    for name, help_ in (
        ("free_slots", "free slots per tier"),
        ("free_runs", "free extents per tier (fragmentation)"),
        ("largest_free_run", "largest free extent per tier"),
    ):
        out.gauge(f"cache_{name}", help_, {t: frag[f"{t}_{name}"] for t in ("device", "host")}, "tier")
    if engine.storage is not None:
        _storage_metrics(out, engine.storage)
    requests = dict(sorted(stats.requests.items())) or {"200": 0}
    out.counter("requests_total", "HTTP requests by status", requests, "status")
    out.histogram("time_to_first_token_seconds", "time to the first token", stats.ttft)
    out.histogram("request_seconds", "request latency", stats.latency)
    return out.text()


def _storage_metrics(out: _Exposition, storage: HostStorageMover) -> None:
    """The storage tier's families, from one snapshot of its counters."""
    m = storage.metrics.snapshot()
    for name, key, help_ in (
        ("bytes_read_total", "bytes_read", "value bytes read from storage and verified"),
        ("bytes_written_total", "bytes_written", "value bytes written to storage"),
        ("pages_read_total", "pages_read", "pages read from storage and verified"),
        ("pages_written_total", "pages_written", "pages written to storage"),
        ("writes_dropped_total", "writes_dropped", "page writes dropped (too many pending)"),
        ("writes_failed_total", "writes_failed", "page writes the backend did not store"),
        ("prefetched_tokens_total", "prefetched_tokens", "tokens prefetched from storage into the host"),
    ):
        out.counter(f"storage_{name}", help_, m[key])
    out.counter("storage_errors_total", "backend calls that failed, by operation", m["errors"], "op")
    out.counter("storage_rejected_total", "values read back and refused, by reason", m["rejected"], "reason")
    out.histogram(
        "storage_prefetch_seconds", "time from a prefetch's start to its end", m["prefetch_seconds"]
    )
    out.histogram("storage_write_seconds", "time from a store's submission to its end", m["write_seconds"])
    usage = storage.backend.usage()
    if usage is not None:
        out.gauge("storage_stored_pages", "pages the backend holds", usage[0])
        out.gauge("storage_stored_bytes", "bytes the backend holds", usage[1])


class _Exposition:
    """Prometheus text, one metric family at a time, every name prefixed `kvtier_`."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, kind: str, name: str, help_: str, value: Any, label: str | None = None) -> None:
        """`value`: one number, or `{label value: number}` under the label `label`."""
        samples = {"": value} if label is None else {f'{{{label}="{k}"}}': v for k, v in value.items()}
        self.lines += [f"# HELP kvtier_{name} {help_}", f"# TYPE kvtier_{name} {kind}"]
        self.lines += [f"kvtier_{name}{labels} {v}" for labels, v in samples.items()]

    counter = partialmethod(metric, "counter")
    gauge = partialmethod(metric, "gauge")

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        """`_bucket` lines (cumulative, the last `le="+Inf"`), then `_sum` and `_count`."""
        self.lines += [f"# HELP kvtier_{name} {help_}", f"# TYPE kvtier_{name} histogram"]
        for bound, n in h.cumulative():
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            self.lines.append(f'kvtier_{name}_bucket{{le="{le}"}} {n}')
        self.lines += [f"kvtier_{name}_sum {h.sum}", f"kvtier_{name}_count {h.count}"]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
