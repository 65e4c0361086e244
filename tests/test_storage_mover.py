"""The host <-> storage mover as a `Mover`: its three operations and their handles over real files, a
refused value deleted or written over, and a backend written before `discard` existed."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from storage_plugin import MemoryBackend, read_into

from kvtier.cache.movers import Mover
from kvtier.cache.storage_mover import (
    Fetch,
    Found,
    HostStorageMover,
    LookupPages,
    ReadPages,
    Store,
    WritePages,
    open_storage,
)
from kvtier.errors import ClosedError, InvariantError
from kvtier.pool import HostPool
from kvtier.spec import preset
from kvtier.storage.backend import StorageBackend, note_source
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import PageCodec

PS = 4
PAGES = 6


def page_bytes(host: HostPool, slot: int) -> bytes:
    return b"".join(bytes(v) for v in host.page_views(slot))


def fill(host: HostPool, slot: int, seed: int) -> bytes:
    """Random bytes into the page at `slot`; returns them."""
    rng = np.random.default_rng(seed)
    for v in host.page_views(slot):
        np.frombuffer(v, np.uint8)[:] = rng.integers(0, 256, len(v), dtype=np.uint8)
    return page_bytes(host, slot)


def put_page(host: HostPool, slot: int, data: bytes) -> None:
    at = 0
    for v in host.page_views(slot):
        np.frombuffer(v, np.uint8)[:] = np.frombuffer(data, np.uint8, len(v), at)
        at += len(v)


def poison(host: HostPool, slot: int, want: bytes) -> None:
    """The complement of `want` into the page at `slot`: a page not read stays visibly wrong."""
    put_page(host, slot, (~np.frombuffer(want, np.uint8)).tobytes())


@pytest.fixture
def setup(tmp_path):
    """A mover over a file store (batches of one page, one reader), its pages written in slots 0.."""
    spec = preset("tiny-mha", page_size=PS)
    host = HostPool(spec, 2 * PAGES * PS, "layer_first")
    cfg = StorageConfig(f"file://{tmp_path / 'store'}", batch_pages=1, workers=1)
    mover = open_storage(cfg, host, Fingerprint.of("mover-test", spec))
    hashes = mover.keys.chain(mover.keys.root, np.arange(PAGES * PS))
    pages = [(h, i * PS) for i, h in enumerate(hashes)]
    want = [fill(host, slot, seed) for seed, (_, slot) in enumerate(pages)]
    yield mover, host, pages, want
    mover.close()
    host.close()


def test_the_storage_mover_is_a_mover_whose_operations_return_handles(setup) -> None:
    mover, host, pages, want = setup
    assert isinstance(mover, Mover)
    store = mover.submit(WritePages(pages))
    assert isinstance(store, Store)
    store.wait()
    assert store.done() and store.ok
    found = mover.submit(LookupPages([h for h, _ in pages]))
    assert isinstance(found, Found) and found.done() and found.pages == PAGES
    for (_, slot), w in zip(pages, want, strict=True):
        poison(host, slot, w)
    fetch = mover.submit(ReadPages(pages))
    assert isinstance(fetch, Fetch)
    mover.drain()  # waits for the fetch as for any operation
    assert fetch.done() and fetch.arrived() == PAGES
    assert [page_bytes(host, slot) for _, slot in pages] == want
    again = mover.submit(WritePages(pages))  # every page stored already: nothing written
    again.wait()
    m = mover.metrics.snapshot()
    assert again.ok and m["writes_present"] == PAGES and m["pages_written"] == PAGES
    with pytest.raises(InvariantError):
        mover.submit(pages)  # not one of its operations
    mover.close()
    with pytest.raises(ClosedError):
        mover.submit(LookupPages([pages[0][0]]))


def test_a_fetch_ends_at_the_first_absent_page_and_every_batch_finishes(setup) -> None:
    mover, host, pages, want = setup
    mover.submit(WritePages(pages)).wait()
    mover.backend.discard(mover.keys.keys([pages[2][0]]))  # page 2 gone, pages 3-5 still there
    for (_, slot), w in zip(pages, want, strict=True):
        poison(host, slot, w)
    fetch = mover.submit(ReadPages(pages))
    assert fetch.wait(timeout=60)
    assert fetch.arrived() == 2 and fetch.arrived() == 2  # read again: the same answer
    assert [page_bytes(host, slot) for _, slot in pages[:2]] == want[:2]
    assert mover.metrics.snapshot()["pages_read"] == 2  # no batch after the miss read a page
    assert mover.submit(LookupPages([h for h, _ in pages])).pages == 2


@pytest.mark.parametrize("damage", ["flip", "longer"])
def test_a_refused_value_is_deleted_and_the_next_write_stores_it_again(setup, damage) -> None:
    """A value refused on read (a flipped byte: `checksum`; longer than a page's value: `get_into`
    says -1, `oversize`) leaves the file backend, so the next write stores the page."""
    mover, host, pages, want = setup
    mover.submit(WritePages(pages)).wait()
    key = mover.keys.key(pages[3][0])
    path = mover.backend.path_of(key)
    with open(path, "rb") as f:
        value = bytearray(f.read())
    if damage == "flip":
        value[-1] ^= 0xFF
    else:
        value += b"\0" * 8
    mover.backend.put([key], [[bytes(value)]])
    fetch = mover.submit(ReadPages(pages))
    fetch.wait()
    reason = "checksum" if damage == "flip" else "oversize"
    assert fetch.arrived() == 3 and mover.metrics.snapshot()["rejected"][reason] == 1
    assert mover.submit(LookupPages([h for h, _ in pages])).pages == 3  # deleted
    put_page(host, pages[3][1], want[3])  # (the refused read wrote the slot it read into)
    assert mover.submit(WritePages(pages)).wait() and mover.metrics.snapshot()["pages_written"] == PAGES + 3
    fetch = mover.submit(ReadPages(pages))
    fetch.wait()
    assert fetch.arrived() == PAGES
    assert [page_bytes(host, slot) for _, slot in pages] == want


class NamedMemory(MemoryBackend):
    """A backend that names its values' sources (as `discard` asks) but has no `discard` of its own."""

    def get_into(self, keys, buffers):
        for key, b in zip(keys, buffers, strict=True):
            if key in self._values:
                note_source(b, self, key)
        return super().get_into(keys, buffers)


class Bare(StorageBackend):
    """The least a backend implements: written before `discard` existed, it names no sources either."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}

    def exists(self, keys):
        return next((n for n, k in enumerate(keys) if k not in self._values), len(keys))

    def get_into(self, keys, buffers):
        return [read_into(self._values.get(k), views) for k, views in zip(keys, buffers, strict=True)]

    def put(self, keys, values):
        for k, v in zip(keys, values, strict=True):
            self._values[k] = b"".join(bytes(c) for c in v)
        return [True] * len(keys)


def test_a_backend_without_discard_logs_once_and_says_it_kept_the_values(caplog) -> None:
    b = Bare()
    b.put(["k1"], [[b"v"]])
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.backend"):
        assert b.discard(["k1"]) is False
        assert b.discard(["k1"]) is False
    assert b.exists(["k1"]) == 1
    assert len([r for r in caplog.records if "no discard" in r.getMessage()]) == 1


@pytest.mark.parametrize("kind", [Bare, NamedMemory])
@pytest.mark.parametrize("damage", ["flip", "longer"])
def test_a_refused_value_a_backend_keeps_is_written_over_by_the_next_write(tmp_path, kind, damage) -> None:
    """Without `discard` the refused value stays present; the next write replaces it instead of
    skipping it as present, and the page reads back whole."""
    spec = preset("tiny-mha", page_size=PS)
    host = HostPool(spec, 2 * PAGES * PS, "layer_first")
    fp = Fingerprint.of("keep", spec)
    backend = kind()
    cfg = StorageConfig(f"file://{tmp_path}", batch_pages=2, workers=2)  # (the URL is not opened)
    mover = HostStorageMover(host, backend, PageKeys(fp, PS), PageCodec(spec, fp), cfg)
    hashes = mover.keys.chain(mover.keys.root, np.arange(PAGES * PS))
    pages = [(h, i * PS) for i, h in enumerate(hashes)]
    want = [fill(host, slot, seed) for seed, (_, slot) in enumerate(pages)]
    try:
        mover.submit(WritePages(pages)).wait()
        key = mover.keys.key(pages[3][0])
        value = bytearray(backend._values[key])
        if damage == "flip":
            value[-1] ^= 0xFF
        else:
            value += b"\0" * 8
        backend._values[key] = bytes(value)
        fetch = mover.submit(ReadPages(pages))
        fetch.wait()
        assert fetch.arrived() == 3
        assert backend.exists(mover.keys.keys(hashes)) == PAGES  # kept: no discard
        put_page(host, pages[3][1], want[3])  # (the refused read wrote the slot it read into)
        store = mover.submit(WritePages(pages))
        store.wait()
        assert store.ok and mover.metrics.snapshot()["writes_present"] == 3  # pages 0-2 skipped
        for (_, slot), w in zip(pages, want, strict=True):
            poison(host, slot, w)
        fetch = mover.submit(ReadPages(pages))
        fetch.wait()
        assert fetch.arrived() == PAGES
        assert [page_bytes(host, slot) for _, slot in pages] == want
        assert not mover.overwrite  # written over: nothing left to replace
    finally:
        mover.close()
        host.close()
