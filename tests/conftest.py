"""Shared helpers: random bytes, poisoned pools, an independent model of host memory, pinned probes."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in its CPU interpreter; the variable must be set
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import BufferSpec
from kvtier.transfer import backup, load_layer


def on_host(t: torch.Tensor) -> torch.Tensor:
    """The host tier: pinned CPU memory when there is a GPU, plain CPU memory otherwise."""
    return t.pin_memory() if torch.cuda.is_available() else t


def on_device(t: torch.Tensor) -> torch.Tensor:
    """The device tier: the GPU when there is one, the CPU (interpreter) otherwise."""
    return t.cuda() if torch.cuda.is_available() else t


def random_rows(n: int, b: BufferSpec, gen: torch.Generator) -> torch.Tensor:
    """`[n, *row]` of `b.dtype` with random bit patterns (NaN payloads included)."""
    raw = torch.randint(0, 256, (n, b.row_bytes), dtype=torch.uint8, generator=gen)
    return raw.view(b.dtype).view(n, *b.row_shape)


def poison_host(pool: HostPool, gen: torch.Generator) -> None:
    """Fill every byte of the host pool with random values."""
    for b in pool.spec.buffers:
        for chunk in pool.chunks(b.name):
            raw = chunk.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def poison_device(pool: DevicePool, gen: torch.Generator) -> None:
    for b in pool.spec.buffers:
        for layer in b.layers:
            t = pool.layer(b.name, layer)
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen)
            )


def host_row(pool: HostPool, b: BufferSpec, layer: int, slot: int) -> torch.Tensor:
    """One host row, addressed by the layout's definition (single-chunk pools only)."""
    (chunk,) = pool.chunks(b.name)
    j = b.local_layer(layer)
    if pool.layout.value == "layer_first":
        return chunk[j, slot]
    ps = pool.spec.page_size
    return chunk[slot // ps, j, slot % ps]


def host_rows(pool: HostPool, b: BufferSpec, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Host rows of `slots` (`[n]` int64) as a copy `[n, *row]`, by the layout's definition (single-chunk
    pools only)."""
    (chunk,) = pool.chunks(b.name)
    j = b.local_layer(layer)
    if pool.layout.value == "layer_first":
        return chunk[j, slots]
    ps = pool.spec.page_size
    return chunk[slots // ps, j, slots % ps]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def pin():
    """`pin(probe, value)`: a once-per-process finding (a `kvtier.transfer.cudart.Probed`: the DMA
    mode, the compiled loop) pinned to `value` for one test; each probe pinned is found afresh
    after it."""
    pinned = []

    def pin_(probe, value):
        probe.set(value)
        pinned.append(probe)
        return value

    yield pin_
    for probe in pinned:
        probe.reset()


# -- Real Redis servers for the storage tests (see tests/redis_servers.py) ---------------------


def _need_redis() -> None:
    """Skip without redis-server, except under CI (env `CI` set), where its absence fails."""
    from redis_servers import have_redis

    if not have_redis():
        msg = "redis-server and redis-cli are not on PATH (apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}; CI must provide them (.ci/redis.sh)", pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A standalone Redis: `$KVTIER_TEST_REDIS_URL`, else a server started for this session.

    Shared by every test of the session: use keys of your own (a uuid prefix), never FLUSHALL."""
    from redis_servers import STANDALONE_ENV, RedisServer

    if url := os.environ.get(STANDALONE_ENV):
        yield url
        return
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    """A 3-master Redis Cluster: `$KVTIER_TEST_REDIS_CLUSTER_URL`, else one started for this session."""
    from redis_servers import CLUSTER_ENV, RedisClusterServers

    if url := os.environ.get(CLUSTER_ENV):
        yield url
        return
    _need_redis()
    cluster = RedisClusterServers.start(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster.url
    cluster.stop()


@pytest.fixture
def redis_server_factory(tmp_path):
    """`start() -> RedisServer`: a private standalone server (`.kill()`, `.start()` on the same port,
    `.url`); every one started is stopped by PID after the test."""
    from redis_servers import RedisServer

    _need_redis()
    started = []

    def start():
        server = RedisServer(tmp_path / f"redis{len(started)}")
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint on disk for `kvtier serve` processes (tests/served.py)."""
    from served import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def served():
    """`kvtier serve` processes started by the test (`.start(...)`), killed when it ends."""
    from served import ServedProcesses

    processes = ServedProcesses()
    yield processes
    processes.kill()


def run_and_check(plan, host: HostPool, dev: DevicePool, hs: torch.Tensor, ds: torch.Tensor, stream) -> None:
    """Run `plan` (`hs` host slots to or from `ds` device slots, `[n]` int64) over every layer on
    `stream`, then check each buffer's rows byte for byte against a copy taken before: a load wrote
    the host rows at `ds` and nothing else on the device, a backup wrote the device rows at `hs`."""
    spec = host.spec
    before = {(b.name, lay): dev.layer(b.name, lay).cpu() for b in spec.buffers for lay in b.layers}
    if plan.direction is Direction.LOAD:
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer, stream)
    else:
        backup(plan, dev, host, stream=stream)
    if stream is not None:
        stream.synchronize()
    for b in spec.buffers:
        for layer in b.layers:
            got = dev.layer(b.name, layer).cpu()
            rows = host.gather(b.name, layer, hs)
            if plan.direction is Direction.LOAD:
                want = before[(b.name, layer)].clone()
                want[ds] = rows
                assert same_bytes(got, want), (plan.path, b.name, layer)
            else:
                assert same_bytes(rows, before[(b.name, layer)][ds]), (plan.path, b.name, layer)
