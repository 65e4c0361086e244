"""The host <-> storage mover: background reads into host slots and writes out of them.

`HostStorageMover` moves pages between a `HostPool` and a `StorageBackend`; like every
mover it never touches the tree. A page is `(page hash, first host slot)`.

- `lookup(hashes)`: how many leading pages storage holds (one `exists` batch, on the
  caller's thread: the only storage call that is).
- `fetch(pages) -> Fetch`: read the pages into their host slots on the read workers, in
  batches of `batch_pages` spread over the workers; each value is checked
  (`PageCodec.check`) before it counts. `Fetch.arrived()` is how many leading pages hold
  their verified bytes; the first page that is absent, refused or failed ends it.
  `Fetch.stop()` starts no batch after it; `Fetch.wait()` returns once no worker writes
  the fetch's slots any more, after which the slots past `arrived()` may be reused.
- `store(pages) -> Store`: write the pages' values on the write workers (pages storage
  already holds, from the first, are skipped); `Store.wait()`; `Store.ok`. The host
  slots must stay unchanged until the store is done.
- `drain()`: wait for every fetch and store; `close()`: stop fetches, finish stores, close
  the backend.

Faults: every backend call is in `try`; an exception or a refused value is counted in
`metrics` (`errors` by operation, `rejected` by reason), logged (at most once per
operation every `LOG_EVERY_S`) and becomes a miss or an unstored page. The workers are a
thread pool whose tasks catch everything, so no fault stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.cache.metrics import StorageMetrics
from kvtier.pool import HostPool
from kvtier.storage.backend import StorageBackend, open_backend
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import PageCodec

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
Page = tuple[bytes, int]  # (page hash, first host slot)


class Fetch:
    """Pages being read from storage into host slots; see the module docstring."""

    def __init__(self, pages: Sequence[Page], batch: int) -> None:
        self.pages = list(pages)
        self.started = time.perf_counter()
        self._batch = batch
        self._lock = threading.Lock()
        self._ok = [-1] * -(-len(self.pages) // batch)  # per batch: verified leading pages, -1 = not done
        self._running = len(self._ok)
        self._idle = threading.Event()
        self._stopped = False
        if not self._running:
            self._idle.set()

    def arrived(self) -> int:
        """Leading pages whose bytes are in their host slots and verified."""
        with self._lock:
            n = 0
            for i, ok in enumerate(self._ok):
                if ok < 0:
                    break
                n += ok
                if ok < self._size(i):
                    break
            return n

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no batch is running or waiting (or `timeout` s); True when idle."""
        return self._idle.wait(timeout)

    @property
    def idle(self) -> bool:
        return self._idle.is_set()

    def _size(self, i: int) -> int:
        return min(self._batch, len(self.pages) - i * self._batch)

    def _should_run(self, i: int) -> bool:
        with self._lock:
            if self._stopped:
                return False
            return all(ok == self._size(j) or ok < 0 for j, ok in enumerate(self._ok[:i]))

    def _finish(self, i: int, ok: int) -> None:
        with self._lock:
            self._ok[i] = ok
            self._running -= 1
            if ok < self._size(i):
                self._stopped = True  # later pages cannot count: start no more batches
            if self._running == 0:
                self._idle.set()


class Store:
    """Pages being written to storage; `ok` once `wait()` returns: every page is stored."""

    def __init__(self, pages: Sequence[Page]) -> None:
        self.pages = list(pages)
        self.started = time.perf_counter()
        self.ok = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def open_storage(config: StorageConfig, host_pool: HostPool, fingerprint: Fingerprint) -> HostStorageMover:
    """The mover between `host_pool` and the backend `config.url` names, keyed under `fingerprint`."""
    scheme = config.url.split("://", 1)[0] if "://" in config.url else ""
    backend = open_backend(config.url, **config.open_options(scheme))
    spec = host_pool.spec
    keys = PageKeys(fingerprint, spec.page_size)
    codec = PageCodec(spec, fingerprint, config.compression)
    log.info(
        "storage tier on %s (%s, prefetch %s)", backend.describe(), config.write.value, config.prefetch.value
    )
    return HostStorageMover(host_pool, backend, keys, codec, config)


class HostStorageMover:
    """Pages between `host_pool` and `backend` under `keys` and `codec`, as `config` says.

    See the module docstring. `config`'s `workers`, `writers` and `batch_pages` size the
    workers; the manager reads its policies from `config` too.
    """

    def __init__(
        self,
        host_pool: HostPool,
        backend: StorageBackend,
        keys: PageKeys,
        codec: PageCodec,
        config: StorageConfig,
    ) -> None:
        self.host_pool, self.backend, self.keys, self.codec = host_pool, backend, keys, codec
        self.config = config
        self.batch_pages = config.batch_pages
        self.metrics = StorageMetrics()
        self._readers = ThreadPoolExecutor(config.workers, thread_name_prefix="kvtier-storage-read")
        self._writers = ThreadPoolExecutor(config.writers, thread_name_prefix="kvtier-storage-write")
        self._fetches: set[Fetch] = set()
        self._stores: set[Store] = set()
        self._lock = threading.Lock()
        self._last_log: dict[str, float] = {}
        self._closed = False

    # -- the caller's side -------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> int:
        """How many of the pages `hashes` names, from the first, storage holds (0 on a fault)."""
        if not hashes:
            return 0
        try:
            return min(len(hashes), max(0, int(self.backend.exists(self.keys.keys(list(hashes))))))
        except Exception as e:
            self._fault("exists", e)
            return 0

    def fetch(self, pages: Sequence[Page]) -> Fetch:
        f = Fetch(pages, self.batch_pages)
        with self._lock:
            self._fetches.add(f)
        for i in range(0, len(f.pages), self.batch_pages):
            self._readers.submit(self._read, f, i // self.batch_pages)
        return f

    def store(self, pages: Sequence[Page]) -> Store:
        s = Store(pages)
        with self._lock:
            self._stores.add(s)
        self._writers.submit(self._write, s)
        return s

    def drain(self) -> None:
        with self._lock:
            fetches, stores = list(self._fetches), list(self._stores)
        for f in fetches:
            f.wait()
        for s in stores:
            s.wait()

    def close(self) -> None:
        """Stop every fetch, finish every store, stop the workers, close the backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            fetches = list(self._fetches)
        for f in fetches:
            f.stop()
        self.drain()
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        try:
            self.backend.close()
        except Exception as e:
            self._fault("close", e)

    # -- the workers' side -------------------------------------------------------------

    def _read(self, f: Fetch, i: int) -> None:
        ok = 0
        try:
            if f._should_run(i):
                ok = self._read_pages(f.pages[i * self.batch_pages :][: f._size(i)])
        except Exception as e:  # a fault is a miss, never a dead worker
            self._fault("get", e)
        finally:
            f._finish(i, ok)
            if f.idle:
                with self._lock:
                    self._fetches.discard(f)

    def _read_pages(self, pages: list[Page]) -> int:
        """Read and check `pages`; returns how many of them, from the first, are verified."""
        views = [self.host_pool.page_views(slot) for _, slot in pages]
        bufs = [self.codec.read_buffers(v) for v in views]
        lengths = self.backend.get_into(self.keys.keys([h for h, _ in pages]), bufs)
        m, ok = self.metrics, 0
        for (h, _), n, b in zip(pages, lengths, bufs, strict=True):
            if n < 0:
                break
            why = self.codec.check(h, n, b)
            if why is not None:
                m.reject(why)
                log.warning("storage value of page %s refused (%s): a miss", h.hex()[:16], why)
                break
            ok += 1
            m.add("bytes_read", n)
        m.add("pages_read", ok)
        return ok

    def _write(self, s: Store) -> None:
        try:
            s.ok = self._write_pages(s.pages)
        except Exception as e:
            self._fault("put", e)
        finally:
            self.metrics.observe("write_seconds", time.perf_counter() - s.started)
            s._done.set()
            with self._lock:
                self._stores.discard(s)

    def _write_pages(self, pages: list[Page]) -> bool:
        m = self.metrics
        present = self.lookup([h for h, _ in pages])
        m.add("writes_present", present)
        stored = True
        for at in range(present, len(pages), self.batch_pages):
            batch = pages[at : at + self.batch_pages]
            values = [self.codec.encode(h, self.host_pool.page_views(slot)) for h, slot in batch]
            try:
                done = self.backend.put(self.keys.keys([h for h, _ in batch]), values)
            except Exception as e:
                self._fault("put", e)
                done = [False] * len(batch)
            for ok, value in zip(done, values, strict=True):
                if ok:
                    m.add("pages_written")
                    m.add("bytes_written", sum(len(c) for c in value))
                else:
                    m.add("writes_failed")
                    stored = False
        return stored

    def _fault(self, op: str, e: BaseException) -> None:
        if op in self.metrics.errors:
            self.metrics.error(op)
        now = time.monotonic()
        if now - self._last_log.get(op, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[op] = now
            log.warning(
                "storage %s on %s failed (%s: %s); counted as a miss",
                op,
                self.backend.name,
                type(e).__name__,
                e,
            )
