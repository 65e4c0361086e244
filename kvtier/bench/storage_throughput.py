"""`kvtier bench storage`, throughput: kvtier's page get and put beside the raw store's, in one run.

For one backend, spec and page size, `pages` pages of random bytes sit in a `HostPool`.
kvtier puts them (`HostStorageMover`, one `WritePages` per `batch_pages` pages, as the cache
issues one per node) and gets them back (one `ReadPages` of every page into the pool). The raw
store moves values of the same length, as many of them, with the threads and batches the
mover uses (its `writers` for puts, its `workers` for gets), and nothing of kvtier:

- files: `open(path, "wb").write(value)` and `readinto` a preallocated buffer, one file per
  value under two levels of shard directories, as the file backend lays values out;
- Redis: redis-py pipelines of `SET`, and of `GET` whose replies are kept as they come.

Before anything is timed, both are checked: the pool and the raw destination are poisoned
with the complement of the expected bytes, read back and compared byte for byte (a kvtier
get must also verify every page); a point that fails is reported, not timed. Each put
sample writes fresh keys (the mover skips pages storage holds), the get samples read the
last put's values, raw and kvtier samples alternate; dirty pages are synced before each put
sample and, with `drop_caches`, the page cache is dropped before each get sample.
Rates are value bytes (header and payload) per second of wall time.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvtier.bench.storage_stores import FileSide, RawFiles, RawRedis, RedisSide, drop_page_cache
from kvtier.cache.storage_mover import HostStorageMover, ReadPages, WritePages, open_storage
from kvtier.pool import HostPool
from kvtier.spec import KVSpec
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import PageCodec

# The bench's socket timeout: a batch of large values can outlast the tier's default on a
# slow host, and a timed-out batch is a miss, not a rate (bench/FINDINGS.md, "The storage tier").
TIMEOUT_S = 60.0


@dataclass
class ThroughputRow:
    """One point: GB/s of each op (None where it was not timed); `identical`: the check held and
    every timed sample completed, else `failure` says what went wrong first."""

    backend: str
    setup: str
    page_size: int
    layout: str
    pages: int
    value_bytes: int
    identical: bool
    failure: str
    kvtier_put_gbps: float | None = None
    raw_put_gbps: float | None = None
    put_ratio: float | None = None
    kvtier_get_gbps: float | None = None
    raw_get_gbps: float | None = None
    get_ratio: float | None = None


# -- one point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One throughput measurement: `pages` pages of `spec` (whose page size it is) in `layout`."""

    setup: str
    spec: KVSpec
    pages: int
    layout: str


def pages_for(spec: KVSpec, point_bytes: int, min_pages: int) -> int:
    """Pages of `spec` that make at least `point_bytes` of values, and at least `min_pages`."""
    value = PageCodec(spec, Fingerprint(bytes(16))).value_bytes
    return max(min_pages, -(-point_bytes // value))


class PoolPages:
    """`n` pages of random bytes in a fresh host pool, and the plain copy they must equal."""

    def __init__(self, spec: KVSpec, n: int, layout: str, rng: np.random.Generator) -> None:
        ps = spec.page_size
        self.pool = HostPool(spec, n * ps, layout)
        payload = ps * spec.bytes_per_token()
        self.expected = np.frombuffer(rng.bytes(n * payload), np.uint8).reshape(n, payload)
        self.slots = [i * ps for i in range(n)]
        self.fill(poison=False)

    def fill(self, poison: bool) -> None:
        """Write the expected bytes (or, with `poison`, their complement) into every page."""
        for i, slot in enumerate(self.slots):
            at = 0
            for v in self.pool.page_views(slot):
                src = self.expected[i, at : at + len(v)]
                np.frombuffer(v, np.uint8)[:] = ~src if poison else src
                at += len(v)

    def first_difference(self) -> int | None:
        """The first page whose bytes in the pool differ from the expected ones, or None."""
        for i, slot in enumerate(self.slots):
            got = np.concatenate([np.frombuffer(v, np.uint8) for v in self.pool.page_views(slot)])
            if not np.array_equal(got, self.expected[i]):
                return i
        return None


@dataclass
class Sample:
    """One put sample's values: kvtier's under `hashes` through `mover`, the raw store's in `raw`."""

    index: int
    mover: HostStorageMover
    raw: RawFiles | RawRedis
    hashes: list[bytes]

    def pages(self, slots: list[int]) -> list[tuple[bytes, int]]:
        return list(zip(self.hashes, slots, strict=True))


def _spread(work: Callable[[range], None], n: int, batch: int, threads: ThreadPoolExecutor) -> float:
    """Seconds to run `work` over `range(n)` in batches of `batch` on `threads`."""
    t0 = time.perf_counter()
    futures = [threads.submit(work, range(at, min(at + batch, n))) for at in range(0, n, batch)]
    for f in futures:
        f.result()
    return time.perf_counter() - t0


def _kvtier_put(sample: Sample, slots: list[int], batch: int) -> tuple[float, str]:
    """Seconds to store every page, one store per `batch` pages; why not all were stored, or ''."""
    pages = sample.pages(slots)
    t0 = time.perf_counter()
    stores = [sample.mover.submit(WritePages(pages[at : at + batch])) for at in range(0, len(pages), batch)]
    for s in stores:
        s.wait()
    seconds = time.perf_counter() - t0
    failed = sum(not s.ok for s in stores)
    return seconds, f"kvtier put: {failed} of {len(stores)} stores left pages unstored" if failed else ""


def _kvtier_get(sample: Sample, slots: list[int]) -> tuple[float, str]:
    """Seconds to fetch every page into its slots; why not every page arrived verified, or ''."""
    t0 = time.perf_counter()
    f = sample.mover.submit(ReadPages(sample.pages(slots)))
    f.wait()
    seconds, arrived = time.perf_counter() - t0, f.arrived()
    if arrived == len(slots):
        return seconds, ""
    m = sample.mover.metrics.snapshot()
    return seconds, (
        f"kvtier get: {arrived} of {len(slots)} pages arrived verified "
        f"(rejected {m['rejected']}, errors {m['errors']})"
    )


def measure(
    side: FileSide | RedisSide, point: Point, repeats: int, drop_caches: bool, seed: int
) -> ThroughputRow:
    """Put and get throughput of kvtier and of the raw store at `point`, checked before it is timed."""
    spec, n = point.spec, point.pages
    fp = Fingerprint.of(f"kvtier-bench/{point.setup}", spec)
    config = _config(side, 0)
    value_bytes = PageCodec(spec, fp).value_bytes
    rng = np.random.default_rng(seed)
    pages = PoolPages(spec, n, point.layout, rng)
    values = np.frombuffer(rng.bytes(n * value_bytes), np.uint8).reshape(n, value_bytes)
    dst = np.empty_like(values)
    row = ThroughputRow(side.name, point.setup, spec.page_size, point.layout, n, value_bytes, False, "")
    times: dict[str, list[float]] = {op: [] for op in ("raw_put", "kvtier_put", "raw_get", "kvtier_get")}
    batch, sample = config.batch_pages, None
    try:
        with ThreadPoolExecutor(config.writers) as writers, ThreadPoolExecutor(config.workers) as readers:
            for s in range(repeats):
                if sample is not None:
                    _discard(side, sample)
                sample = _new_sample(side, s, fp, pages)
                row.failure = _timed(s, _put_ops(sample, pages, values, batch, writers), times, os.sync)
                if row.failure:
                    return row
            row.failure = _check(sample, pages, values, dst, batch, readers)
            if row.failure:
                return row
            get = _get_ops(sample, pages, dst, batch, readers)
            before = drop_page_cache if drop_caches else _nothing
            for s in range(repeats):
                row.failure = _timed(s, get, times, before)
                if row.failure:
                    return row
        row.identical = True
    finally:
        if sample is not None:
            _discard(side, sample)
        pages.pool.close()
        _rates(row, n * value_bytes, times)
    return row


def _config(side: FileSide | RedisSide, sample: int) -> StorageConfig:
    """The tier's defaults, but a socket timeout that a pipeline of several MB values fits in."""
    return StorageConfig(side.url(sample), timeout_s=TIMEOUT_S)


def _new_sample(side: FileSide | RedisSide, index: int, fp: Fingerprint, pages: PoolPages) -> Sample:
    """A mover over the sample's store and fresh page hashes (random tokens: no run finds them stored)."""
    ps = pages.pool.spec.page_size
    keys = PageKeys(fp, ps)
    tokens = np.random.default_rng().integers(0, 1 << 31, len(pages.slots) * ps)
    mover = open_storage(_config(side, index), pages.pool, fp)
    return Sample(index, mover, side.raw(index), keys.chain(keys.root, tokens))


def _put_ops(sample: Sample, pages: PoolPages, values: np.ndarray, batch: int, threads) -> dict:
    """The raw and the kvtier put of one sample, each `() -> (seconds, failure)`."""
    n = len(pages.slots)
    return {
        "raw_put": lambda: (_spread(lambda i: sample.raw.put(i, values), n, batch, threads), ""),
        "kvtier_put": lambda: _kvtier_put(sample, pages.slots, batch),
    }


def _get_ops(sample: Sample, pages: PoolPages, dst: np.ndarray, batch: int, threads) -> dict:
    """The raw and the kvtier get of the last sample, each `() -> (seconds, failure)`."""
    n = len(pages.slots)
    return {
        "raw_get": lambda: (_spread(lambda i: sample.raw.get(i, dst), n, batch, threads), ""),
        "kvtier_get": lambda: _kvtier_get(sample, pages.slots),
    }


def _discard(side: FileSide | RedisSide, sample: Sample) -> None:
    sample.mover.close()
    side.clear(sample.index, sample.mover.keys.keys(sample.hashes))


def _nothing() -> None:
    pass


def _timed(index: int, ops: dict[str, Callable[[], tuple[float, str]]], times, before) -> str:
    """Run each op once after `before()`, raw and kvtier first in turn by `index`; the first failure."""
    order = list(ops.items())
    for name, op in order if index % 2 == 0 else order[::-1]:
        before()
        seconds, failure = op()
        if failure:
            return failure
        times[name].append(seconds)
    return ""


def _check(sample: Sample, pages: PoolPages, values: np.ndarray, dst: np.ndarray, batch: int, readers) -> str:
    """Why kvtier's or the raw store's get does not give back the bytes put (into poisoned memory), or ''."""
    n = len(pages.slots)
    pages.fill(poison=True)
    if failure := _kvtier_get(sample, pages.slots)[1]:
        return failure
    if (bad := pages.first_difference()) is not None:
        return f"kvtier get: page {bad} of {n} differs from the bytes put"
    np.bitwise_not(values, out=dst)
    _spread(lambda i: sample.raw.get(i, dst, check=True), n, batch, readers)
    differs = np.flatnonzero((dst != values).any(axis=1))
    return f"raw get: value {differs[0]} of {n} differs from the bytes put" if len(differs) else ""


def _rates(row: ThroughputRow, nbytes: int, times: dict[str, list[float]]) -> None:
    """Fill `row`'s GB/s (of the median sample) and kvtier/raw ratios."""
    gbps = {op: round(nbytes / statistics.median(t) / 1e9, 3) for op, t in times.items() if t}
    for op in ("put", "get"):
        kv, raw = gbps.get(f"kvtier_{op}"), gbps.get(f"raw_{op}")
        setattr(row, f"kvtier_{op}_gbps", kv)
        setattr(row, f"raw_{op}_gbps", raw)
        setattr(row, f"{op}_ratio", round(kv / raw, 3) if kv and raw else None)
