"""The host <-> storage mover: a `Mover` whose operations look pages up, read them into host
slots and write them out of them.

`HostStorageMover` moves pages between a `HostPool` and a `StorageBackend`; like every mover
(`kvtier.cache.movers`) it never touches the tree: `submit(op)` returns the operation's handle
at once (`done()`, `wait()`), `drain()` waits for every read and write submitted, `close()`
stops the reads, finishes the writes and closes the backend (idempotent); a `submit` after it
raises `ClosedError`. A page is `(page hash, first host slot)`. One type per operation, each
with its handle (both in `kvtier.cache.storage_io`):

- `LookupPages(hashes) -> Found`: `Found.pages`, how many of the pages, from the first,
  storage holds (one `exists` batch, on the caller's thread: the only storage call that is,
  so the handle is done when returned).
- `ReadPages(pages) -> Fetch`: read the pages into their host slots on the read workers, in
  batches of `batch_pages` spread over the workers; each value is checked
  (`PageCodec.check`) before it counts. `Fetch.arrived()`: how many leading pages hold
  their verified bytes; the first page that is absent, refused or failed ends it (no later
  batch starts). `Fetch.stop()` starts no batch after it; `Fetch.wait()` returns once no
  worker writes the fetch's slots any more (`done()`), after which the slots past
  `arrived()` may be reused.
- `WritePages(pages) -> Store`: write the pages' values on the write workers, skipping the
  leading pages storage already holds (one `exists` batch) unless one of them was refused
  on read and kept by its backend; `Store.ok` once done: every page is stored. The host
  slots must stay unchanged until the store is done.

A value refused on read (damaged, torn, another model's, longer than a page's value) is
deleted from its backend where the backend can (`ValueBuffers.discard`); where it cannot (a
backend without `discard`, or one that does not name its values' sources) the page is kept
in `overwrite` (at most `OVERWRITE_PAGES`, oldest forgotten first), so the next write of the
page replaces the value instead of skipping it as present. Either way the refusal is a miss
now and not for ever.

Faults: every backend call is in `try`; an exception or a refused value is counted in
`metrics` (`errors` by operation, `rejected` by reason), logged (at most once per
operation every `LOG_EVERY_S`) and becomes a miss or an unstored page. The workers are a
thread pool whose tasks catch everything, so no fault stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import overload

from kvtier.cache.metrics import StorageMetrics
from kvtier.cache.movers import Mover
from kvtier.cache.storage_io import (
    Fetch,
    Found,
    LookupPages,
    Page,
    ReadPages,
    StorageHandle,
    StorageOp,
    Store,
    WritePages,
)
from kvtier.errors import ClosedError, InvariantError
from kvtier.pool import HostPool
from kvtier.storage.backend import StorageBackend, ValueBuffers, open_backend
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import ABSENT, PageCodec

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
# Pages refused on read that their backend kept, remembered so the next write replaces them.
OVERWRITE_PAGES = 65536


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


class HostStorageMover(Mover[StorageOp, StorageHandle]):
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
        self.overwrite: OrderedDict[bytes, None] = OrderedDict()  # page hashes, oldest first
        self._readers = ThreadPoolExecutor(config.workers, thread_name_prefix="kvtier-storage-read")
        self._writers = ThreadPoolExecutor(config.writers, thread_name_prefix="kvtier-storage-write")
        self._fetches: set[Fetch] = set()
        self._stores: set[Store] = set()
        self._lock = threading.Lock()
        self._last_log: dict[str, float] = {}
        self._closed = False

    # -- the caller's side -------------------------------------------------------------

    @overload
    def submit(self, op: LookupPages) -> Found: ...
    @overload
    def submit(self, op: ReadPages) -> Fetch: ...
    @overload
    def submit(self, op: WritePages) -> Store: ...

    def submit(self, op: StorageOp) -> StorageHandle:
        """Start `op` (see the module docstring); `ClosedError` after `close()`."""
        if self._closed:
            raise ClosedError(f"storage mover on {self.backend.name} used after close()")
        if isinstance(op, LookupPages):
            return Found(self._present(op.hashes))
        if isinstance(op, ReadPages):
            return self._fetch(op.pages)
        if isinstance(op, WritePages):
            return self._store(op.pages)
        raise InvariantError(f"the storage mover moves LookupPages, ReadPages or WritePages, not {op!r}")

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

    def _present(self, hashes: Sequence[bytes]) -> int:
        """How many of the pages `hashes` names, from the first, storage holds (0 on a fault)."""
        if not hashes:
            return 0
        try:
            return min(len(hashes), max(0, int(self.backend.exists(self.keys.keys(list(hashes))))))
        except Exception as e:
            self._fault("exists", e)
            return 0

    def _fetch(self, pages: Sequence[Page]) -> Fetch:
        f = Fetch(pages, self.batch_pages)
        with self._lock:
            self._fetches.add(f)
        for i in range(f.batches):
            self._readers.submit(self._read, f, i)
        return f

    def _store(self, pages: Sequence[Page]) -> Store:
        s = Store(pages)
        with self._lock:
            self._stores.add(s)
        self._writers.submit(self._write, s)
        return s

    # -- the workers' side -------------------------------------------------------------

    def _read(self, f: Fetch, i: int) -> None:
        ok = 0
        try:
            if f._should_run(i):
                ok = self._read_pages(f._batch_pages(i))
        except Exception as e:  # a fault is a miss, never a dead worker
            self._fault("get", e)
        finally:
            f._finish(i, ok)
            if f.done():
                with self._lock:
                    self._fetches.discard(f)

    def _read_pages(self, pages: list[Page]) -> int:
        """Read and check `pages`; returns how many of them, from the first, are verified."""
        views = [self.host_pool.page_views(slot) for _, slot in pages]
        bufs = [self.codec.read_buffers(v) for v in views]
        lengths = self.backend.get_into(self.keys.keys([h for h, _ in pages]), bufs)
        m, ok = self.metrics, 0
        for (h, _), n, b in zip(pages, lengths, bufs, strict=True):
            why = self.codec.check(h, n, b)
            if why is not None:
                if why != ABSENT:
                    m.reject(why)
                    log.warning("storage value of page %s refused (%s): a miss", h.hex()[:16], why)
                self._refused(h, b)  # (an absent page too: a backend may not tell it from one too long)
                break
            ok += 1
            m.add("bytes_read", n)
        m.add("pages_read", ok)
        return ok

    def _refused(self, h: bytes, buffers: ValueBuffers) -> None:
        """Page `h`'s value was refused: where its backend kept it, the next write replaces it."""
        if buffers.discarded:
            return
        with self._lock:
            self.overwrite[h] = None
            self.overwrite.move_to_end(h)
            while len(self.overwrite) > OVERWRITE_PAGES:
                self.overwrite.popitem(last=False)

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
        present = self._present([h for h, _ in pages])
        with self._lock:  # a refused value its backend kept is written over, not skipped
            kept = self.overwrite
            present = next((i for i, (h, _) in enumerate(pages[:present]) if h in kept), present)
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
            for (h, _), ok, value in zip(batch, done, values, strict=True):
                if ok:
                    m.add("pages_written")
                    m.add("bytes_written", sum(len(c) for c in value))
                    if self.overwrite:
                        with self._lock:
                            self.overwrite.pop(h, None)
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
