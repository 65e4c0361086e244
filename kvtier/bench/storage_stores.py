"""The raw stores `kvtier bench storage` compares kvtier with, and where each sample's values go.

- `RawFiles`: value `i` in one file under two levels of shard directories, as the file
  backend lays values out, written by `open(path, "wb").write` and read by `readinto`.
- `RawRedis`: redis-py pipelines of `SET`, and of `GET` whose replies are kept as they come
  (copied out only for the check).
- `FileSide` / `RedisSide`: the store URL and raw store of each put sample, and deleting a
  sample's values once it is done with (a directory per sample; keys on a shared server).
- `read_files(paths, threads, batch)`: every file of a file store read plainly, as the
  tier's readers would (the TTFT part's raw read rate).
- `local_redis()`: a `redis-server` of this process on a free loopback port, persistence
  off, stopped by its PID; `drop_page_cache()`: `sync`, then `/proc/sys/vm/drop_caches`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import xxhash

from kvtier.errors import ConfigError

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the OS page cache; False where this process may not."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


# -- the raw stores ------------------------------------------------------------------------


class RawFiles:
    """Value `i` in the file `root/ab/cd/v<i>` (`abcd`: the name's xxh64), written and read plainly."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, i: int) -> Path:
        name = f"v{i:08d}"
        h = xxhash.xxh64_hexdigest(name.encode())
        return self.root / h[:2] / h[2:4] / name

    def put(self, idx: range, values: np.ndarray) -> None:
        """Write `values[i]` (`[n, value_bytes]` uint8) for each `i` in `idx`."""
        for i in idx:
            path = self.path(i)
            try:
                with open(path, "wb") as f:
                    f.write(values[i].data)
            except FileNotFoundError:  # the shard's first value makes its directories
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "wb") as f:
                    f.write(values[i].data)

    def get(self, idx: range, dst: np.ndarray, check: bool = False) -> None:
        """Read value `i` into `dst[i]` (`[n, value_bytes]` uint8) for each `i` in `idx`, checked or not."""
        for i in idx:
            read_into(self.path(i), memoryview(dst[i]))


class RawRedis:
    """Value `i` under the key `<prefix><i>`, by redis-py `SET` and `GET` pipelines."""

    def __init__(self, client, prefix: str) -> None:
        self.client, self.prefix = client, prefix

    def keys(self, idx: range) -> list[str]:
        return [f"{self.prefix}{i}" for i in idx]

    def put(self, idx: range, values: np.ndarray) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i, k in zip(idx, self.keys(idx), strict=True):
            pipe.set(k, values[i].data)
        pipe.execute()

    def get(self, idx: range, dst: np.ndarray, check: bool = False) -> None:
        """`GET` each value; copied into `dst[i]` (`[n, value_bytes]` uint8) only to `check` it."""
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys(idx):
            pipe.get(k)
        replies = pipe.execute()
        if check:
            for i, reply in zip(idx, replies, strict=True):
                if isinstance(reply, bytes) and len(reply) == dst.shape[1]:
                    dst[i] = np.frombuffer(reply, np.uint8)


class FileSide:
    """Where each put sample's values go on disk: a kvtier store and a raw directory of its own."""

    name = "file"

    def __init__(self, root: Path) -> None:
        self.root = root

    def url(self, sample: int) -> str:
        return f"file://{self.root / f'kvtier-{sample}'}"

    def raw(self, sample: int) -> RawFiles:
        return RawFiles(self.root / f"raw-{sample}")

    def clear(self, sample: int, kvtier_keys: list[str]) -> None:
        """Delete sample `sample`'s values (kvtier's under `kvtier_keys`, and the raw ones)."""
        shutil.rmtree(self.root / f"kvtier-{sample}", ignore_errors=True)
        shutil.rmtree(self.root / f"raw-{sample}", ignore_errors=True)

    def close(self) -> None:
        pass


class RedisSide:
    """One Redis server for every sample; its keys are deleted once a sample is done with."""

    name = "redis"

    def __init__(self, url: str) -> None:
        import redis

        self.server = url
        self.client = redis.Redis.from_url(url)

    def url(self, sample: int) -> str:
        return self.server

    def raw(self, sample: int) -> RawRedis:
        return RawRedis(self.client, f"kvtier-bench-raw-{os.getpid()}-{sample}-")

    def close(self) -> None:
        self.client.close()

    def clear(self, sample: int, kvtier_keys: list[str]) -> None:
        """Delete sample `sample`'s values (kvtier's under `kvtier_keys`, and the raw ones)."""
        keys = kvtier_keys + self.raw(sample).keys(range(len(kvtier_keys)))
        for at in range(0, len(keys), 256):
            self.client.delete(*keys[at : at + 256])


@contextmanager
def local_redis() -> Iterator[str]:
    """A `redis-server` of this process on a free loopback port (no persistence); its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ConfigError("no redis-server on PATH: give --redis URL or leave redis out of --backends")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise ConfigError(f"redis-server on port {port} exited ({proc.returncode})") from None
                time.sleep(0.05)
        else:
            raise ConfigError(f"redis-server on port {port} did not answer within 5 s")
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def read_into(path: str | Path, row: memoryview) -> None:
    """Fill `row` from the start of the file at `path`, plainly (`readinto`, resuming short reads)."""
    with open(path, "rb", buffering=0) as f:
        at = 0
        while at < len(row) and (n := f.readinto(row[at:])):
            at += n


def store_files(root: Path) -> list[str]:
    """Every file under `root` (a file store's values), in directory order."""
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def read_files(paths: list[str], threads: int, batch: int) -> tuple[float, int]:
    """Seconds to `readinto` every file at `paths` into one preallocated buffer, `batch` files per
    task on `threads` threads (as the mover reads); and the bytes read."""
    sizes = [os.stat(p).st_size for p in paths]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    dst = memoryview(np.empty(int(offsets[-1]), np.uint8))

    def read(idx: range) -> None:
        for i in idx:
            read_into(paths[i], dst[offsets[i] : offsets[i + 1]])

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        for f in [
            pool.submit(read, range(at, min(at + batch, len(paths)))) for at in range(0, len(paths), batch)
        ]:
            f.result()
        return time.perf_counter() - t0, int(offsets[-1])
