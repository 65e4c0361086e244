"""The storage backends through the real file system and real Redis processes (no mock of a store)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.errors import ClosedError, ConfigError, StorageError
from kvtier.storage.backend import ValueBuffers, open_backend
from kvtier.storage.file import FileBackend
from kvtier.storage.redis import RedisBackend, RedisTarget, parse_redis_url

KINDS = ["file", "redis", "redis+cluster"]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def open_store(kind, tmp_path, request):
    """`open_store(**options)`: a backend of `kind` (closed after the test)."""
    opened = []

    def open_(**options):
        if kind == "file":
            url = f"file://{tmp_path / 'store'}"
        else:
            url = request.getfixturevalue("redis_url" if kind == "redis" else "redis_cluster_url")
        opened.append(open_backend(url, **options))
        return opened[-1]

    yield open_
    for b in opened:
        b.close()


@pytest.fixture
def store(open_store):
    return open_store()


@pytest.fixture
def keys():
    """`keys(n)`: n keys shaped like page keys, unique to this test (the Redis servers are shared)."""
    ns = uuid.uuid4().hex

    def keys_(n: int, start: int = 0) -> list[str]:
        return [f"{ns}.{i:064x}" for i in range(start, start + n)]

    return keys_


def random_bytes(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def split_sizes(total: int, parts: int = 3) -> list[int]:
    """Uneven sizes summing to `total` (fewer parts when `total` is small)."""
    cuts = sorted({total * k // (2 * parts - k) for k in range(1, parts)} - {0, total})
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def chunks_of(value: bytes, parts: int = 3) -> list[memoryview]:
    """`value` as numpy arrays' memoryviews, one per part."""
    out, off = [], 0
    for n in split_sizes(len(value), parts):
        out.append(memoryview(np.frombuffer(value, np.uint8, n, off).copy()))
        off += n
    return out


def poisoned(expected: bytes, total: int, parts: int = 3) -> list[np.ndarray]:
    """Destination arrays of `total` bytes in all: the complement of `expected`, then 0x5A."""
    flat = np.full(total, 0x5A, np.uint8)
    flat[: len(expected)] = ~np.frombuffer(expected, np.uint8)
    return [a.copy() for a in np.split(flat, np.cumsum(split_sizes(total, parts))[:-1])]


def views(arrays: list[np.ndarray]) -> list[memoryview]:
    return [memoryview(a) for a in arrays]


def joined(arrays: list[np.ndarray]) -> bytes:
    return b"".join(a.tobytes() for a in arrays)


# -- every backend ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 100_000, 4 << 20])
def test_round_trip_is_byte_identical(store, keys, size):
    ks = keys(3)
    values = [random_bytes(size, seed) for seed in range(3)]
    assert store.put(ks, [chunks_of(v) for v in values]) == [True] * 3
    dests = [poisoned(v, size) for v in values]
    assert store.get_into(ks, [views(d) for d in dests]) == [size] * 3
    for v, d in zip(values, dests, strict=True):
        assert joined(d) == v


def test_buffers_of_any_item_type(store, keys):
    (k,) = keys(1)
    src = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    assert store.put([k], [[memoryview(src[:16]), memoryview(src[16:])]]) == [True]
    dest = np.full((2, 64, 32), np.nan, np.float16)  # 2-D float16 views, as host slots are
    assert store.get_into([k], [[memoryview(dest[0]), memoryview(dest[1])]]) == [src.nbytes]
    assert dest.tobytes() == src.tobytes()


def test_exists_counts_leading_values(store, keys):
    ks = keys(5)
    assert store.put([ks[0], ks[1], ks[3]], [[b"a"], [b"b"], [b"d"]]) == [True] * 3
    assert store.exists(ks) == 2
    assert store.exists(ks[3:4]) == 1
    assert store.exists([ks[2], ks[0]]) == 0
    assert store.exists([]) == 0


def test_missing_longer_and_shorter_values(store, keys):
    present, absent = keys(2)
    value = random_bytes(1000, 7)
    assert store.put([present], [[value]]) == [True]
    assert store.get_into([absent], [[memoryview(bytearray(2000))]]) == [-1]
    assert store.get_into([present], [views(poisoned(b"", 999))]) == [-1]
    short = poisoned(value, 1500)
    exact = poisoned(value, 1000)
    dests = [views(short), [memoryview(bytearray(10))], views(exact)]
    got = store.get_into([present, absent, present], dests)
    assert got == [1000, -1, 1000]
    assert joined(exact) == value
    assert joined(short) == value + b"\x5a" * 500  # what follows a shorter value is untouched


def test_a_value_found_names_its_source_and_an_absent_key_does_not(store, keys):
    """A -1 with its source named is a value too long, which the reader can discard; one without is
    an absent key."""
    present, absent = keys(2)
    assert store.put([present], [[random_bytes(1000, 7)]]) == [True]
    short, missing = ValueBuffers([memoryview(bytearray(999))]), ValueBuffers([memoryview(bytearray(10))])
    fits = ValueBuffers([memoryview(bytearray(1000))])
    assert store.get_into([present, absent, present], [short, missing, fits]) == [-1, -1, 1000]
    assert short.source == (store, present) and fits.source == (store, present) and missing.source is None
    assert not missing.discard() and missing.discarded is None
    assert short.discard() and short.discarded is True
    assert store.exists([present]) == 0


def test_put_overwrites(store, keys):
    (k,) = keys(1)
    old, new = random_bytes(200_000, 1), random_bytes(150_000, 2)
    assert store.put([k], [[old]]) == [True]
    assert store.put([k], [chunks_of(new)]) == [True]
    dest = poisoned(new, 150_000)
    assert store.get_into([k], [views(dest)]) == [150_000]
    assert joined(dest) == new


def test_empty_value(store, keys):
    (k,) = keys(1)
    assert store.put([k], [[]]) == [True]
    assert store.exists([k]) == 1
    assert store.get_into([k], [[memoryview(bytearray(4))]]) == [0]


def test_threads_put_and_get_concurrently(store, keys):
    errors: list[str] = []

    def worker(t: int) -> None:
        try:
            for round_ in range(4):
                ks = keys(4, start=t * 100 + round_ * 4)
                values = [random_bytes(50_000 + 3_001 * i + t, t * 1000 + round_ * 10 + i) for i in range(4)]
                if store.put(ks, [chunks_of(v) for v in values]) != [True] * 4:
                    errors.append(f"thread {t}: put failed")
                dests = [poisoned(v, len(v)) for v in values]
                got = store.get_into(ks, [views(d) for d in dests])
                same = [joined(d) == v for d, v in zip(dests, values, strict=True)]
                if got != [len(v) for v in values] or not all(same):
                    errors.append(f"thread {t} round {round_}: got {got}")
        except Exception as e:
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


@pytest.mark.parametrize("bad", ["a/b", "", "..", "ключ", "a b", "x" * 201, "a~1"])
def test_bad_keys_raise_storage_error(store, keys, bad):
    for call in (
        lambda: store.exists([bad]),
        lambda: store.put([*keys(1), bad], [[b"x"], [b"y"]]),
        lambda: store.get_into([bad], [[memoryview(bytearray(1))]]),
    ):
        with pytest.raises(StorageError):
            call()
    assert store.exists(keys(1)) == 0  # the good key of the refused batch was not written


def test_mismatched_batches_raise_storage_error(store, keys):
    with pytest.raises(StorageError):
        store.put(keys(2), [[b"x"]])
    with pytest.raises(StorageError):
        store.get_into(keys(2), [[memoryview(bytearray(1))]])
    with pytest.raises(StorageError):
        store.get_into(keys(1), [[memoryview(b"read-only")]])


def test_closed_backend_raises(open_store, keys):
    b = open_store()
    b.close()
    b.close()
    with pytest.raises(ClosedError):
        b.exists(keys(1))


# -- open_backend -------------------------------------------------------------------------


def test_open_backend_by_url(tmp_path):
    with open_backend(f"file://{tmp_path}/s", size_bytes=10) as b:
        assert (b.name, b.root, b.size_bytes) == ("file", str(tmp_path / "s"), 10)
    with open_backend("redis://127.0.0.1:1/3", pool_size=2, ttl_s=5, timeout_s=0.5) as b:
        assert (b.name, b.target.db, b.pool_size, b.ttl_s, b.timeout_s) == ("redis", 3, 2, 5, 0.5)
    with open_backend("redis+cluster://127.0.0.1:1,127.0.0.1:2") as b:
        assert b.name == "redis+cluster"


def test_plugin_backend_by_module_path(keys):
    with open_backend("storage_plugin:MemoryBackend?x=1&y=a", y="b") as b:
        assert (b.name, b.options) == ("memory", {"x": "1", "y": "b"})
        ks = keys(2)
        assert b.put(ks, [[b"ab", b"c"], [b"d"]]) == [True, True]
        dest = bytearray(5)
        assert (b.exists(ks), b.get_into(ks[:1], [[memoryview(dest)]])) == (2, [3])
        assert dest[:3] == b"abc"


@pytest.mark.parametrize(
    "url",
    ["", "ftp://x", "no_such_module_kvtier:Backend", "storage_plugin:NoSuchClass", "collections:OrderedDict"],
)
def test_open_backend_rejects_unknown_urls(url):
    with pytest.raises(ConfigError):
        open_backend(url)


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("redis://127.0.0.1:6380/2", RedisTarget(False, (("127.0.0.1", 6380),), 2)),
        ("redis://cache.local", RedisTarget(False, (("cache.local", 6379),))),
        ("redis://u:pw@h:7/", RedisTarget(False, (("h", 7),), 0, "u", "pw")),
        ("redis://[::1]:7000", RedisTarget(False, (("::1", 7000),))),
        ("redis+cluster://a:1,b:2,[::1]:3", RedisTarget(True, (("a", 1), ("b", 2), ("::1", 3)))),
    ],
)
def test_parse_redis_url(url, target):
    assert parse_redis_url(url) == target


@pytest.mark.parametrize(
    "url",
    [
        "redis://",
        "redis://:6379",
        "redis://h:0",
        "redis://h:65536",
        "redis://h:port",
        "redis://h:1/db",
        "redis://h:1?db=2",
        "redis://a:1,b:2",
        "redis://::1",
        "redis+cluster://a:1,b:2/0",
        "redis+cluster://a:1,,b:2",
        "rediss://h:1",
    ],
)
def test_bad_redis_urls_raise_config_error(url):
    with pytest.raises(ConfigError):
        RedisBackend(url)


@pytest.mark.parametrize("options", [{"pool_size": 0}, {"ttl_s": -1}, {"ttl_s": 0.5}, {"timeout_s": 0}])
def test_bad_redis_options_raise_config_error(options):
    with pytest.raises(ConfigError):
        RedisBackend("redis://127.0.0.1:1", **options)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
def test_redis_without_a_server_builds_and_then_raises_storage_error(url, keys):
    with RedisBackend(url, timeout_s=0.5) as b:  # nothing listens on port 1: built anyway (lazy)
        for _ in range(2):  # the first fails to connect, the second inside the back-off
            with pytest.raises(StorageError):
                b.put(keys(1), [[b"x"]])


# -- the file backend -----------------------------------------------------------------------


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_file_layout_is_sharded(tmp_path, keys):
    root = tmp_path / "s"
    ks = keys(1000)
    with FileBackend(str(root)) as b:
        assert b.put(ks, [[k.encode()] for k in ks]) == [True] * 1000
        files = files_under(root)
        assert sorted(files) == sorted(Path(b.path_of(k)) for k in ks)
    assert {len(f.relative_to(root).parts) for f in files} == {3}  # root/ab/cd/KEY, none in the root
    per_leaf: dict[Path, int] = {}
    for f in files:
        per_leaf[f.parent] = per_leaf.get(f.parent, 0) + 1
    assert max(per_leaf.values()) <= 4
    assert len({f.parent.parent for f in files}) > 200


WRITER = """
import sys
import numpy as np
from kvtier.storage.file import FileBackend
root, key, w = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = FileBackend(root)
for i in range(50):
    v = np.random.default_rng(w * 1000 + i).integers(0, 256, 100_000 + 997 * i, dtype=np.uint8)
    assert b.put([key], [[memoryview(v[:5000]), memoryview(v[5000:])]]) == [True]
"""


def writer_value(w: int, i: int) -> bytes:
    return np.random.default_rng(w * 1000 + i).integers(0, 256, 100_000 + 997 * i, dtype=np.uint8).tobytes()


def test_file_two_processes_writing_one_key_leave_one_whole_value(tmp_path, keys):
    root, (key,) = tmp_path / "s", keys(1)
    whole = {writer_value(w, i) for w in (1, 2) for i in range(50)}
    env = {**os.environ, "PYTHONPATH": str(Path(kvtier.__file__).parents[1])}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(root), key, str(w)], env=env) for w in (1, 2)
    ]
    reads = 0
    with FileBackend(str(root)) as b:
        while any(p.poll() is None for p in writers) or reads == 0:
            dest = bytearray(200_000)
            (n,) = b.get_into([key], [[memoryview(dest)]])
            if n >= 0:
                assert bytes(dest[:n]) in whole
                reads += 1
        assert [p.wait() for p in writers] == [0, 0]
        (n,) = b.get_into([key], [[memoryview(dest)]])
        assert bytes(dest[:n]) in {writer_value(1, 49), writer_value(2, 49)}
    assert [f.name for f in files_under(root)] == [key]  # no temporary file left


def test_file_size_cap_evicts_least_recently_used(tmp_path, keys):
    ks = keys(30)
    with FileBackend(str(tmp_path / "s"), size_bytes=10_000) as b:
        assert b.put(ks[:10], [[random_bytes(1000, i)] for i in range(10)]) == [True] * 10
        assert b.get_into([ks[0]], [[memoryview(bytearray(1000))]]) == [1000]  # 0 becomes the newest
        for i in range(10, 19):
            assert b.put([ks[i]], [[random_bytes(1000, i)]]) == [True]
        present = {k for k in ks if b.exists([k])}
        assert present == {ks[0], *ks[10:19]}
        for i in range(19, 30):
            assert b.put([ks[i]], [[random_bytes(1000, i)]]) == [True]
        assert [k for k in ks if b.exists([k])] == ks[20:]
        assert b.usage() == (10, 10_000)
        assert (b.evicted_values, b.evicted_bytes) == (20, 20_000)
        assert len(files_under(tmp_path / "s")) == 10
        assert b.put([ks[0]], [[bytes(10_001)]]) == [False]  # larger than the cap: dropped
        assert (b.dropped_values, b.exists([ks[0]]), b.usage()) == (1, 0, (10, 10_000))


def test_file_values_of_another_process_join_the_index(tmp_path, keys):
    ks = keys(2)
    with FileBackend(str(tmp_path / "s")) as mine, FileBackend(str(tmp_path / "s")) as theirs:
        assert theirs.put(ks, [[b"abc"], [b"de"]]) == [True, True]
        assert mine.usage() == (0, 0)
        assert mine.exists(ks) == 2
        assert mine.usage() == (2, 5)
        theirs.put([ks[0]], [[b"abcdef"]])
        os.unlink(theirs.path_of(ks[1]))
        assert mine.get_into(ks, [[memoryview(bytearray(8))]] * 2) == [6, -1]
        assert mine.usage() == (1, 6)


def test_file_restart_rebuilds_the_index(tmp_path, keys):
    root, ks = tmp_path / "s", keys(5)
    values = [random_bytes(10_000 + i, i) for i in range(5)]
    with FileBackend(str(root)) as b:
        assert b.put(ks, [[v] for v in values]) == [True] * 5
        for i, k in enumerate(ks):  # write order as mtimes, oldest first
            os.utime(b.path_of(k), (1_000_000 + i, 1_000_000 + i))
        stale, live = b.path_of(ks[0]) + "~99999-1-0", b.path_of(ks[1]) + "~99999-1-1"
    Path(stale).write_bytes(b"torn")
    os.utime(stale, (time.time() - 3600,) * 2)
    Path(live).write_bytes(b"being written")
    with FileBackend(str(root)) as b:
        assert b.usage() == (5, sum(map(len, values)))
        dests = [poisoned(v, len(v)) for v in values]
        assert b.get_into(ks, [views(d) for d in dests]) == [len(v) for v in values]
        assert [joined(d) for d in dests] == values
    assert not Path(stale).exists()
    assert Path(live).exists()  # a writer may still be at work on it
    os.unlink(live)
    cap = sum(map(len, values[2:]))
    with FileBackend(str(root), size_bytes=cap) as b:  # a smaller cap keeps the newest by mtime
        assert b.usage() == (3, cap)
        assert [b.exists([k]) for k in ks] == [0, 0, 1, 1, 1]


def test_file_config_errors_create_nothing(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    new = str(tmp_path / "new")
    for path, size in [(str(tmp_path / "f"), 0), ("", 0), (new, -1), (new, "1"), (new, True)]:
        with pytest.raises(ConfigError):
            FileBackend(path, size_bytes=size)
    assert not (tmp_path / "new").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (needs root and a kernel that lets this process mount)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_file_full_disk_drops_the_write(tiny_disk, keys):
    big, small, after = keys(3)
    with FileBackend(str(tiny_disk / "s")) as b:
        assert b.put([big, small], [chunks_of(random_bytes(2 << 20, 1)), [b"fits"]]) == [False, True]
        assert (b.dropped_values, b.dropped_bytes) == (1, 2 << 20)
        assert b.exists([big]) == 0 and b.exists([small]) == 1
        assert [f.name for f in files_under(tiny_disk)] == [small]  # the partial temporary file is gone
        assert b.put([after], [[b"still works"]]) == [True]


# -- Redis -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["redis", "redis+cluster"])
def test_redis_ttl_expires_values(open_store, keys):
    b = open_store(ttl_s=1)
    ks = keys(3)
    assert b.put(ks, [[b"x"]] * 3) == [True] * 3
    assert b.exists(ks) == 3
    deadline = time.monotonic() + 10
    while b.exists(ks[:1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.exists(ks) == 0


def test_redis_server_killed_then_back(redis_server_factory, keys):
    server = redis_server_factory()
    ks, value = keys(2), random_bytes(300_000, 3)
    with RedisBackend(server.url, timeout_s=1.0) as b:
        assert b.put(ks[:1], [[value]]) == [True]
        server.kill()
        with pytest.raises(StorageError):
            b.get_into(ks[:1], [[memoryview(bytearray(300_000))]])
        with pytest.raises(StorageError):  # inside the back-off: refused without a connection
            b.exists(ks)
        server.start()  # same port, empty (persistence is off)
        deadline, stored = time.monotonic() + 15, None
        while stored is None and time.monotonic() < deadline:
            try:
                stored = b.put(ks[1:], [chunks_of(value)])
            except StorageError:
                time.sleep(0.1)
        assert stored == [True]
        dest = poisoned(value, len(value))
        assert b.get_into(ks, [[memoryview(bytearray(1))], views(dest)]) == [-1, len(value)]
        assert joined(dest) == value
