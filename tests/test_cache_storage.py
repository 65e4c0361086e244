"""The cache's third tier through the real file system: round trips, policies, faults, restarts.

Every KV byte is a function of the token prefix it belongs to (`kv_of`), so whatever path
a page took (device, host, storage, several trips), a load is compared with that function,
into device slots poisoned first.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import poison_device

from kvtier.cache import CacheConfig, CacheController
from kvtier.cache.storage_mover import LookupPages, open_storage
from kvtier.errors import ConfigError
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset
from kvtier.storage.backend import StorageBackend
from kvtier.storage.config import StorageConfig
from kvtier.storage.file import FileBackend
from kvtier.storage.keys import Fingerprint, PageKeys

PS = 4


def kv_of(tokens: np.ndarray, spec, buffer: str, layer: int, rank: int | None = None) -> torch.Tensor:
    """`[len(tokens), row bytes]` uint8: the KV of each position, a hash of its prefix (and of `rank`,
    where a rank's rows differ)."""
    b = spec.buffer(buffer)
    out = np.empty((len(tokens), b.row_bytes), dtype=np.uint8)
    key = f"{buffer}/{layer}" if rank is None else f"{buffer}/{layer}/{rank}"
    h = hashlib.blake2b(key.encode(), digest_size=16)
    for i, t in enumerate(tokens.tolist()):
        h.update(int(t).to_bytes(8, "little"))
        seed = int.from_bytes(h.copy().digest()[:8], "little")
        out[i] = np.random.default_rng(seed).integers(0, 256, b.row_bytes, dtype=np.uint8)
    return torch.from_numpy(out)


def write_kv(dev: DevicePool, tokens: np.ndarray, slots: torch.Tensor, at: int = 0) -> None:
    """Compute (fill in) the KV of `tokens[at:]` into `slots`."""
    for b in dev.spec.buffers:
        for layer in b.layers:
            t = dev.layer(b.name, layer).view(torch.uint8).view(dev.num_slots, -1)
            t[slots] = kv_of(tokens, dev.spec, b.name, layer)[at:]


def assert_kv(dev: DevicePool, tokens: np.ndarray, slots: torch.Tensor) -> None:
    for b in dev.spec.buffers:
        for layer in b.layers:
            t = dev.layer(b.name, layer).view(torch.uint8).view(dev.num_slots, -1)
            want = kv_of(tokens, dev.spec, b.name, layer)
            assert torch.equal(t[slots], want), f"{b.name} layer {layer} differs"


def make_cache(
    tmp_path,
    spec_name="tiny-mha",
    layout="layer_first",
    dev_slots=64,
    host_slots=64,
    model="test-model",
    **storage,
):
    spec = preset(spec_name, page_size=PS)
    dev, host = DevicePool(spec, dev_slots, "cpu"), HostPool(spec, host_slots, layout)
    cfg = StorageConfig(storage.pop("url", f"file://{tmp_path / 'store'}"), **storage)
    mover = open_storage(cfg, host, Fingerprint.of(model, spec))
    return CacheController(dev, host, CacheConfig(), storage=mover)


def compute(c: CacheController, tokens: np.ndarray) -> None:
    """A request: whatever the cache holds is reused, the rest computed and inserted."""
    m = c.match(tokens)
    lease = c.acquire(m)
    h = c.load_back(m)
    h.wait()
    prefix = torch.cat([m.device_slots, h.device_slots])
    new = c.alloc_device(len(tokens) - len(prefix))
    write_kv(c.device_pool, tokens, new, at=len(prefix))
    c.insert(tokens, torch.cat([prefix, new]))
    c.release(lease)


def evict_all(c: CacheController) -> None:
    c.flush()
    c.poll()
    c.evict_device(c.device_pool.num_slots)
    c.evict_host(c.host_pool.num_slots)
    c.check_invariants()


def reload(c: CacheController, tokens: np.ndarray):
    """Match, prefetch and load `tokens` into poisoned device slots; returns (match, handle, lease)."""
    poison_device(c.device_pool, torch.Generator().manual_seed(7))
    m = c.match(tokens)
    lease = c.acquire(m)
    c.check_invariants()
    h = c.load_back(m)
    h.wait()
    c.poll()
    return m, h, lease


@pytest.fixture(params=["file", "redis", "redis+cluster"])
def store_url(request, tmp_path) -> str:
    """A store of each backend: a fresh directory, or the session's Redis servers."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")


@pytest.mark.parametrize("spec_name", ["tiny-mha", "tiny-mla-fp8", "tiny-dsa"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("compression", ["none", "zstd", "lz4"])
def test_a_prefix_comes_back_from_storage_byte_identical(
    tmp_path, store_url, spec_name, layout, compression
) -> None:
    model = f"round-trip-{uuid.uuid4().hex}"  # the Redis servers are shared: keys of this test only
    with make_cache(tmp_path, spec_name, layout, url=store_url, model=model, compression=compression) as c:
        tokens = np.arange(100, 132)
        compute(c, tokens)
        evict_all(c)
        assert c.tree.nodes() == []  # only storage holds it now
        m, h, lease = reload(c, tokens)
        assert (m.device_tokens, m.storage_tokens, m.storage_tokens_used, h.tokens) == (0, 32, 32, 32)
        assert_kv(c.device_pool, tokens, h.device_slots)
        c.release(lease)
        c.check_invariants()
        assert c.storage.metrics.snapshot()["rejected"] == dict.fromkeys(c.storage.metrics.rejected, 0)


def test_many_trips_between_tiers_keep_the_bytes(tmp_path) -> None:
    with make_cache(tmp_path, "tiny-dsa", dev_slots=32, host_slots=32) as c:
        a, b = np.arange(0, 24), np.concatenate([np.arange(0, 8), np.arange(500, 516)])
        for _ in range(4):
            for tokens in (a, b):
                compute(c, tokens)
                c.flush()
                c.check_invariants()
        for tokens in (a, b):
            evict_all(c)
            m, h, lease = reload(c, tokens)
            assert m.tokens == len(tokens) and m.storage_tokens_used > 0
            assert_kv(c.device_pool, tokens, torch.cat([m.device_slots, h.device_slots]))
            c.release(lease)


def test_the_store_survives_a_restart(tmp_path) -> None:
    tokens = np.arange(7, 7 + 40)
    with make_cache(tmp_path) as c:
        compute(c, tokens)
    with make_cache(tmp_path) as c:  # a new process over the same directory
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens_used == 40
        assert_kv(c.device_pool, tokens, h.device_slots)
        c.release(lease)


def test_a_partial_hit_then_a_new_suffix(tmp_path) -> None:
    with make_cache(tmp_path) as c:
        first = np.arange(0, 16)
        compute(c, first)
        evict_all(c)
        longer = np.arange(0, 28)
        m, h, lease = reload(c, longer)
        assert m.storage_tokens_used == 16
        c.release(lease)
        compute(c, longer)
        evict_all(c)
        m, h, lease = reload(c, longer)
        assert m.storage_tokens_used == 28
        assert_kv(c.device_pool, longer, h.device_slots)
        c.release(lease)


def _store_files(c: CacheController, tokens: np.ndarray) -> list[str]:
    keys = PageKeys(c.storage.keys.fingerprint, PS)
    return [c.storage.backend.path_of(k) for k in keys.keys(keys.chain(keys.root, tokens))]


def _corrupt(path: str, how: str, other: str | None = None) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "flip":
        data[-1] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) - 5]
    elif how == "replace":
        data = bytearray(Path(other).read_bytes())
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("flip", "checksum"),
        ("truncate", "truncated"),
        ("other_tokens", "tokens"),
        ("other_model", "fingerprint"),
    ],
)
def test_a_bad_value_is_a_miss_counted_never_wrong_kv(tmp_path, how, reason) -> None:
    tokens = np.arange(50, 74)  # 6 pages; page 3 goes bad
    with make_cache(tmp_path) as c:
        compute(c, tokens)
        other = np.arange(900, 924)
        compute(c, other)
        evict_all(c)
        files = _store_files(c, tokens)
        if how in ("flip", "truncate"):
            _corrupt(files[3], how)
        elif how == "other_tokens":
            _corrupt(files[3], "replace", _store_files(c, other)[3])
        else:
            spec = c.spec
            foreign = PageKeys(Fingerprint.of("another-model", spec), PS)
            with make_cache(tmp_path / "foreign") as f:
                f.storage.keys = foreign  # a second model's cache writes its own values
                f.storage.codec.fingerprint = foreign.fingerprint
                compute(f, tokens)
                f.flush()
                src = f.storage.backend.path_of(foreign.keys(foreign.chain(foreign.root, tokens))[3])
            _corrupt(files[3], "replace", src)
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens == 24 and m.storage_tokens_used == 12  # pages 0-2 only
        assert_kv(c.device_pool, tokens[:12], h.device_slots)
        assert c.storage.metrics.snapshot()["rejected"][reason] == 1
        c.release(lease)
        c.check_invariants()


@pytest.mark.parametrize(("damage", "reason"), [("flip", "checksum"), ("longer", "oversize")])
def test_a_damaged_value_is_deleted_and_the_next_store_writes_it_again(
    tmp_path, store_url, damage, reason
) -> None:
    """A value refused on read (a flipped byte; or longer than a page's value, which `get_into` answers
    -1 for) leaves its backend: the next store of the page writes it again (it is not skipped as
    present), and a later reload gets the whole prefix from storage."""
    model = f"damaged-{uuid.uuid4().hex}"  # the Redis servers are shared: keys of this test only
    tokens = np.arange(50, 74)  # 6 pages; page 3 goes bad
    with make_cache(tmp_path, url=store_url, model=model) as c:
        compute(c, tokens)
        evict_all(c)
        keys = PageKeys(c.storage.keys.fingerprint, PS)
        bad = keys.keys(keys.chain(keys.root, tokens))[3]
        backend = c.storage.backend
        value = bytearray(c.storage.codec.value_bytes + 1)
        n = backend.get_into([bad], [[memoryview(value)]])[0]
        if damage == "flip":
            value[n - 1] ^= 0xFF  # one flipped payload byte, written back through the backend
        else:
            value[n:] = b"\0" * 8  # the value and 8 bytes more
            n += 8
        assert backend.put([bad], [[bytes(value[:n])]]) == [True]

        m, h, lease = reload(c, tokens)
        assert m.storage_tokens_used == 12  # pages 0-2: page 3 was refused
        assert c.storage.metrics.snapshot()["rejected"][reason] == 1
        assert backend.exists([bad]) == 0  # refused, and deleted
        assert_kv(c.device_pool, tokens[:12], h.device_slots)
        c.release(lease)

        compute(c, tokens)  # pages 3-5 computed again: write-through stores them
        evict_all(c)
        assert backend.exists([bad]) == 1
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens_used == 24  # the whole prefix from storage again
        assert_kv(c.device_pool, tokens, h.device_slots)
        assert c.storage.metrics.snapshot()["rejected"][reason] == 1
        c.release(lease)
        c.check_invariants()


class Flaky(StorageBackend):
    """A real file backend whose calls fail while `broken` is set, or take `delay_s` each."""

    name = "flaky"

    def __init__(self, path: str, delay_s: str = "0") -> None:
        self.inner = FileBackend(path)
        self.broken = False
        self.delay_s = float(delay_s)
        self.gets = 0

    def _maybe_fail(self) -> None:
        if self.broken:
            raise OSError("injected")
        time.sleep(self.delay_s)

    def exists(self, keys):
        return self.inner.exists(keys)

    def get_into(self, keys, buffers):
        self.gets += 1
        self._maybe_fail()
        return self.inner.get_into(keys, buffers)

    def put(self, keys, values):
        self._maybe_fail()
        return self.inner.put(keys, values)


def test_a_backend_that_raises_is_a_miss_and_the_workers_live_on(tmp_path) -> None:
    url = f"test_cache_storage:Flaky?path={tmp_path / 'store'}"
    tokens = np.arange(0, 32)
    with make_cache(tmp_path, url=url, workers=2) as c:
        compute(c, tokens)
        evict_all(c)
        c.storage.backend.broken = True
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens == 32 and m.storage_tokens_used == 0 and h.tokens == 0
        c.release(lease)
        assert c.storage.metrics.snapshot()["errors"]["get"] >= 1
        c.storage.backend.broken = False
        for _ in range(3):  # the same workers serve the next fetches
            m, h, lease = reload(c, tokens)
            assert m.storage_tokens_used == 32
            assert_kv(c.device_pool, tokens, h.device_slots)
            c.release(lease)
            evict_all(c)
        c.check_invariants()


def test_prefetch_policies(tmp_path) -> None:
    tokens = np.arange(0, 64)  # 16 pages in batches of 1, each get 50 ms
    url = f"test_cache_storage:Flaky?path={tmp_path / 'store'}&delay_s=0.05"
    kw = {"url": url, "workers": 1, "batch_pages": 1, "dev_slots": 64, "host_slots": 64}
    with make_cache(tmp_path, **kw, prefetch="best_effort") as c:
        compute(c, tokens)
        evict_all(c)
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens == 64 and m.storage_tokens_used < 64  # did not wait for all
        assert_kv(c.device_pool, tokens[: m.storage_tokens_used], h.device_slots)
        c.release(lease)
        c.check_invariants()
    with make_cache(tmp_path, **kw, prefetch="wait_complete") as c:
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens_used == 64
        c.release(lease)
    timeout = {"timeout_base_s": 0.12, "timeout_per_1k_s": 0.0}
    with make_cache(tmp_path, **kw, prefetch="timeout", **timeout) as c:
        m, h, lease = reload(c, tokens)
        assert 0 < m.storage_tokens_used < 64
        assert_kv(c.device_pool, tokens[: m.storage_tokens_used], h.device_slots)
        c.release(lease)
        c.check_invariants()


def test_short_storage_hits_are_not_prefetched(tmp_path) -> None:
    tokens = np.arange(0, 16)
    with make_cache(tmp_path, min_tokens=32) as c:
        compute(c, tokens)
        evict_all(c)
        m = c.match(tokens)
        assert m.storage_tokens == 0
        assert c.storage.metrics.snapshot()["skipped_short_tokens"] == 16


def test_release_without_load_ends_the_prefetch_and_keeps_what_arrived(tmp_path) -> None:
    tokens = np.arange(0, 32)
    with make_cache(tmp_path) as c:
        compute(c, tokens)
        evict_all(c)
        m = c.match(tokens)
        lease = c.acquire(m)
        m.prefetch.wait()
        c.release(lease)
        c.check_invariants()
        (node,) = c.tree.nodes()
        assert node.state.value == "host_stored" and len(node) == 32 and node.lock == 0


def test_write_back_stores_a_page_when_the_host_evicts_it_and_at_close(tmp_path) -> None:
    a, b = np.arange(0, 32), np.arange(300, 332)
    with make_cache(tmp_path, write="write_back", dev_slots=64, host_slots=32) as c:
        compute(c, a)
        c.flush()
        c.poll()
        assert c.storage.metrics.snapshot()["pages_written"] == 0  # write-through would have
        c.evict_device(64)  # a is host-only now and fills the host
        compute(c, b)
        c.flush()
        c.evict_device(64)  # b's backup evicts a from the host: a goes to storage first
        c.flush()
        c.poll()
        assert c.storage.submit(LookupPages(_hashes(c, a))).pages == 8
        c.check_invariants()
    with make_cache(tmp_path) as c:  # b, still on the host at close, was written then
        assert c.storage.submit(LookupPages(_hashes(c, b))).pages == 8


def _hashes(c: CacheController, tokens: np.ndarray) -> list[bytes]:
    return c.storage.keys.chain(c.storage.keys.root, tokens)


def test_writes_beyond_the_pending_cap_are_dropped_not_waited_for(tmp_path) -> None:
    url = f"test_cache_storage:Flaky?path={tmp_path / 'store'}&delay_s=0.2"
    with make_cache(tmp_path, url=url, writers=1, max_pending_write_tokens=8) as c:
        for i in range(4):
            compute(c, np.arange(i * 100, i * 100 + 8))
        c.flush()  # completes the backups, which start (or drop) the writes
        c.poll()
        assert c.storage.metrics.snapshot()["writes_dropped"] >= 1


def test_concurrent_writers_of_one_page_leave_one_valid_value(tmp_path) -> None:
    tokens = np.arange(0, 32)
    caches = [make_cache(tmp_path / "own" / str(i), url=f"file://{tmp_path / 'shared'}") for i in range(3)]
    try:
        threads = [threading.Thread(target=compute, args=(c, tokens)) for c in caches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in caches:
            c.flush()
    finally:
        for c in caches:
            c.close()
    with make_cache(tmp_path, url=f"file://{tmp_path / 'shared'}") as c:
        m, h, lease = reload(c, tokens)
        assert m.storage_tokens_used == 32
        assert_kv(c.device_pool, tokens, h.device_slots)
        c.release(lease)


def test_bad_storage_config_is_refused_before_anything_starts(tmp_path) -> None:
    with pytest.raises(ConfigError):
        StorageConfig(f"file://{tmp_path}", prefetch="sometimes")
    with pytest.raises(ConfigError):
        StorageConfig(f"file://{tmp_path}", workers=0)
    with pytest.raises(ConfigError):
        make_cache(tmp_path, url="ftp://nowhere")
    assert not os.path.exists(tmp_path / "store")
