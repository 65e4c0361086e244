"""The host <-> storage mover's operations, one type each, and the handles its `submit` returns.

Values and handles only: `kvtier.cache.storage_mover.HostStorageMover` runs the operations
and finishes the handles (its docstring has the contract). A page is `(page hash, first host
slot)`. Every handle has `done()` (no waiting) and `wait(timeout=None) -> bool` (whether it
is done), as `kvtier.cache.movers.Handle` asks:

- `LookupPages(hashes) -> Found`: `pages`, known when returned;
- `ReadPages(pages) -> Fetch`: `arrived()`, the leading pages verified in their host slots;
  `stop()`; done once no worker writes its slots any more;
- `WritePages(pages) -> Store`: `ok` once done, whether every page is stored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

Page = tuple[bytes, int]  # (page hash, first host slot)


@dataclass(frozen=True)
class LookupPages:
    """Ask how many of the pages `hashes` names, from the first, storage holds."""

    hashes: Sequence[bytes]


@dataclass(frozen=True)
class ReadPages:
    """Read `pages` from storage into their host slots."""

    pages: Sequence[Page]


@dataclass(frozen=True)
class WritePages:
    """Write `pages`' host slots to storage."""

    pages: Sequence[Page]


StorageOp = LookupPages | ReadPages | WritePages


class Found:
    """A `LookupPages`' answer, done when returned: `pages` storage holds, from the first (0 on a fault)."""

    def __init__(self, pages: int) -> None:
        self.pages = pages

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


class Fetch:
    """Pages being read from storage into host slots (a `ReadPages`'); see the storage mover's
    docstring. Its batches are finished (`_finish`) by the mover's read workers."""

    def __init__(self, pages: Sequence[Page], batch: int) -> None:
        self.pages = list(pages)
        self.started = time.perf_counter()
        self._batch = batch
        self._lock = threading.Lock()
        self.batches = -(-len(self.pages) // batch)
        self._ok: list[int | None] = [None] * self.batches  # per batch: verified leading pages, once done
        self._running = self.batches
        self._idle = threading.Event()
        self._stopped = False
        if not self._running:
            self._idle.set()

    def arrived(self) -> int:
        """Leading pages whose bytes are in their host slots and verified."""
        with self._lock:
            n = 0
            for i, ok in enumerate(self._ok):
                if ok is None:
                    break
                n += ok
                if ok < self._size(i):
                    break
            return n

    def stop(self) -> None:
        """Start no batch after this (those running finish)."""
        with self._lock:
            self._stopped = True

    def done(self) -> bool:
        """Whether no batch is running or waiting: no worker writes the fetch's slots any more."""
        return self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `done()` (or `timeout` s); returns `done()`."""
        return self._idle.wait(timeout)

    def _size(self, i: int) -> int:
        return min(self._batch, len(self.pages) - i * self._batch)

    def _batch_pages(self, i: int) -> list[Page]:
        return self.pages[i * self._batch :][: self._size(i)]

    def _should_run(self, i: int) -> bool:
        with self._lock:
            if self._stopped:
                return False
            return all(ok is None or ok == self._size(j) for j, ok in enumerate(self._ok[:i]))

    def _finish(self, i: int, ok: int) -> None:
        with self._lock:
            self._ok[i] = ok
            self._running -= 1
            if ok < self._size(i):
                self._stopped = True  # later pages cannot count: start no more batches
            if self._running == 0:
                self._idle.set()


class Store:
    """Pages being written to storage (a `WritePages`'); `ok` once done: every page is stored."""

    def __init__(self, pages: Sequence[Page]) -> None:
        self.pages = list(pages)
        self.started = time.perf_counter()
        self.ok = False
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until `done()` (or `timeout` s); returns `done()`."""
        return self._done.wait(timeout)


StorageHandle = Found | Fetch | Store
