"""The cache's counters: fixed-size, so nothing grows with the number of operations.

`CacheMetrics` holds counters since the controller was built and fixed-bucket
histograms (`Histogram`) of durations; a scrape reads them in O(buckets).
`StorageMetrics` holds the storage tier's, updated from its worker threads under a lock
(`add`, `error`, `reject`, `observe`); `snapshot()` reads them all at one instant.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, fields

# Upper bounds in seconds of a duration histogram's buckets (the last bucket is +inf).
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Observations counted into buckets with upper bounds `bounds` (ascending) and one past them.

    `counts[i]`: observations `<= bounds[i]` and above `bounds[i - 1]`; `counts[-1]`: above
    every bound. `cumulative()` gives the Prometheus form.
    """

    bounds: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """`(upper bound, observations <= it)` per bucket, the last bound `inf`."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass
class CacheMetrics:
    """Counters since the controller was built (bytes are KV bytes over all layers).

    `load_seconds`: each load back from its submission until the cache saw it complete
    (completion is seen when polled, so this is an upper bound).
    """

    matches: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    miss_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    backups: int = 0
    backups_skipped: int = 0
    device_evictions: int = 0
    device_evicted_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0
    dropped_tokens: int = 0
    failed_submissions: int = 0
    load_submit_s: float = 0.0
    load_seconds: Histogram = field(default_factory=Histogram)


# Operations whose failures are counted apart (`errors[op]`).
OPERATIONS = ("exists", "get", "put")
# Why a value read back was refused (`rejected[reason]`); each is a miss, never wrong KV.
REJECTIONS = ("checksum", "truncated", "oversize", "header", "fingerprint", "tokens")


@dataclass
class StorageMetrics:
    """Counters since the tier was built; `errors` by operation, `rejected` by reason."""

    lookups: int = 0
    hit_tokens: int = 0
    prefetches: int = 0
    prefetched_tokens: int = 0
    prefetch_abandoned_tokens: int = 0
    skipped_short_tokens: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    writes_present: int = 0
    writes_dropped: int = 0
    writes_failed: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))
    prefetch_seconds: Histogram = field(default_factory=Histogram)
    write_seconds: Histogram = field(default_factory=Histogram)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def error(self, op: str) -> None:
        with self._lock:
            self.errors[op] += 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def observe(self, histogram: str, seconds: float) -> None:
        with self._lock:
            getattr(self, histogram).observe(seconds)

    def snapshot(self) -> dict:
        """Every counter as plain values (histograms as `Histogram` copies), read at one instant."""
        with self._lock:
            out = {}
            for f in fields(self):
                v = getattr(self, f.name)
                if isinstance(v, dict):
                    v = dict(v)
                elif isinstance(v, Histogram):
                    v = Histogram(v.bounds, list(v.counts), v.count, v.sum)
                out[f.name] = v
            return out
