"""The storage tier's counters, updated from its worker threads: fixed in size, thread-safe.

`StorageMetrics.add(name, n)` and `error(op)` take a lock; a scrape (`snapshot()`) reads
everything under the same lock. Durations go to fixed-bucket `Histogram`s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from kvtier.cache.metrics import Histogram

# Operations whose failures are counted apart (`errors[op]`).
OPERATIONS = ("exists", "get", "put")
# Why a value read back was refused (`rejected[reason]`); each is a miss, never wrong KV.
REJECTIONS = ("checksum", "truncated", "header", "fingerprint", "tokens")


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
    worker_restarts: int = 0
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
