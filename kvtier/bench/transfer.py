"""`kvtier bench transfer`: every path at every fragmentation, against the ceiling of the same run.

For one layer of a prefix of `tokens` tokens it builds host slot sets from one run to
fully scattered (and after fill/evict churn of each allocator policy), device slots
contiguous or scattered, and times each applicable path in each direction. The
ceiling is one contiguous pinned copy of the same bytes, measured in the same run.
Every timed path is first checked byte for byte against the host rows, with the
destination poisoned so an unwritten row shows.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvtier.alloc import AllocPolicy
from kvtier.bench.slots import after_churn, runs_of
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import KVSpec
from kvtier.transfer import TransferPath, TransferPlan, backup, load_layer

# Issuing more copies than this from Python takes seconds; such a row says nothing new.
MAX_TIMED_COPIES = 4096


@dataclass
class BenchConfig:
    spec: KVSpec
    tokens: int
    layout: HostLayout
    device: torch.device
    repeats: int
    warmup: int
    cycles: int
    batch: int = 4
    run_lengths: tuple[int, ...] = (1, 16, 64, 256)
    directions: tuple[Direction, ...] = (Direction.LOAD, Direction.BACKUP)
    seed: int = 0


@dataclass
class Row:
    direction: str
    path: str
    planned: bool
    host_runs: str
    host_run_count: int
    device: str
    tokens: int
    nbytes: int
    ms: float
    gbps: float
    ceiling_ratio: float
    identical: bool


class Timer:
    """Median milliseconds of a callable: CUDA events on `stream`, or the host clock on CPU."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device, self.stream = device, stream

    def median_ms(self, fn: Callable[[], None], repeats: int, warmup: int, batch: int = 1) -> float:
        """Median over `repeats` of the time of `batch` back-to-back calls, divided by `batch`.

        Back-to-back calls time a layer as a multi-layer load runs it: the host issues
        the next layer while the previous one still moves.
        """
        for _ in range(warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / batch)
            return statistics.median(times)
        times = []
        with torch.cuda.stream(self.stream):
            for _ in range(repeats):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record(self.stream)
                for _ in range(batch):
                    fn()
                end.record(self.stream)
                end.synchronize()
                times.append(start.elapsed_time(end) / batch)
        return statistics.median(times)


def run(cfg: BenchConfig, progress: Callable[[str], None] = lambda _msg: None) -> tuple[list[Row], dict]:
    """Run the benchmark; returns the rows and the run's metadata (ceilings, versions)."""
    spec = cfg.spec
    gen = torch.Generator().manual_seed(cfg.seed)
    host_slots = 4 * cfg.tokens
    dev_slots = 2 * cfg.tokens
    progress(f"pinning a host pool of {host_slots} slots")
    host = HostPool(spec, host_slots, cfg.layout)
    dev = DevicePool(spec, dev_slots, cfg.device, staging_tokens=cfg.tokens)
    _fill_random(host, dev, gen)
    stream = torch.cuda.Stream(cfg.device) if cfg.device.type == "cuda" else None
    timer = Timer(cfg.device, stream)
    layer_bytes = cfg.tokens * spec.layer_bytes_per_token(0)

    ceilings = {d: _ceiling_gbps(cfg, timer, layer_bytes, d) for d in cfg.directions}
    progress("ceilings: " + ", ".join(f"{d.value} {g:.1f} GB/s" for d, g in ceilings.items()))

    host_sets = {"contiguous": torch.arange(cfg.tokens, 2 * cfg.tokens)}
    for length in sorted(cfg.run_lengths, reverse=True):
        host_sets[f"runs-{length}"] = runs_of(max(length, spec.page_size), cfg.tokens, host_slots, gen)
    for policy in AllocPolicy:
        progress(f"{cfg.cycles} fill/evict cycles with the {policy.value} allocator")
        host_sets[f"{policy.value}-churn"] = after_churn(
            policy, cfg.tokens, host_slots, spec.page_size, cfg.cycles, cfg.seed
        )
    dev_sets = {
        "contiguous": torch.arange(cfg.tokens),
        "scattered": torch.randperm(dev_slots, generator=gen)[: cfg.tokens],
    }

    rows: list[Row] = []
    for direction in cfg.directions:
        for host_label, hs in host_sets.items():
            for dev_label, ds in dev_sets.items():
                planned = TransferPlan.build(direction, host, dev, hs, ds, stream=stream)
                for path in _paths_to_time(planned):
                    plan = TransferPlan.build(direction, host, dev, hs, ds, force=path, stream=stream)
                    progress(f"{direction.value} {host_label} / device {dev_label}: {path.value}")
                    identical = _check(plan, host, dev, gen, stream)
                    op = _op(plan, host, dev, stream)
                    if path is TransferPath.REFERENCE:
                        ms = timer.median_ms(op, 3, 1)
                    else:
                        ms = timer.median_ms(op, cfg.repeats, cfg.warmup, cfg.batch)
                    gbps = layer_bytes / ms / 1e6
                    rows.append(
                        Row(
                            direction=direction.value,
                            path=path.value,
                            planned=path is planned.path,
                            host_runs=host_label,
                            host_run_count=plan.host_runs,
                            device=dev_label,
                            tokens=cfg.tokens,
                            nbytes=layer_bytes,
                            ms=round(ms, 4),
                            gbps=round(gbps, 2),
                            ceiling_ratio=round(gbps / ceilings[direction], 3),
                            identical=identical,
                        )
                    )
    meta = _metadata(cfg, ceilings, layer_bytes)
    return rows, meta


def _paths_to_time(planned: TransferPlan) -> list[TransferPath]:
    paths = [planned.path]
    for path in (
        TransferPath.SINGLE_COPY,
        TransferPath.STAGED,
        TransferPath.PER_RUN,
        TransferPath.REFERENCE,
    ):
        if path in paths:
            continue
        if path is TransferPath.SINGLE_COPY and planned.joint_runs != 1:
            continue
        if path is TransferPath.PER_RUN and planned.joint_runs > MAX_TIMED_COPIES:
            continue
        if path is TransferPath.STAGED and planned.host_runs > MAX_TIMED_COPIES:
            continue
        paths.append(path)
    return paths


def _op(plan: TransferPlan, host: HostPool, dev: DevicePool, stream) -> Callable[[], None]:
    if plan.direction is Direction.LOAD:
        return lambda: load_layer(plan, host, dev, 0, stream)
    return lambda: backup(plan, dev, host, [0], stream)


def _fill_random(host: HostPool, dev: DevicePool, gen: torch.Generator) -> None:
    for b in host.spec.buffers:
        for chunk in host.chunks(b.name):
            raw = chunk.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        for layer in b.layers:
            t = dev.layer(b.name, layer).view(torch.uint8)
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))


def _check(plan: TransferPlan, host: HostPool, dev: DevicePool, gen: torch.Generator, stream) -> bool:
    """Run the plan once onto a poisoned destination; every target row must equal its source and
    every other row of the destination must keep its poison."""
    buffers = host.spec.buffers_on(0)
    all_host = torch.arange(host.num_slots)
    for b in buffers:
        if plan.direction is Direction.LOAD:
            raw = dev.layer(b.name, 0).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        else:
            raw = torch.randint(0, 256, (host.num_slots, b.row_bytes), dtype=torch.uint8, generator=gen)
            host.scatter(b.name, 0, all_host, raw.view(b.dtype).view(host.num_slots, *b.row_shape))
    if plan.direction is Direction.LOAD:
        before = {b.name: _bytes(dev.layer(b.name, 0)) for b in buffers}
    else:
        before = {b.name: _bytes(host.gather(b.name, 0, all_host)) for b in buffers}
    _op(plan, host, dev, stream)()
    if dev.device.type == "cuda":
        torch.cuda.synchronize(dev.device)
    ok = True
    for b in buffers:
        dev_rows = _bytes(dev.layer(b.name, 0))
        host_rows = _bytes(host.gather(b.name, 0, all_host))
        expected = before[b.name].clone()
        if plan.direction is Direction.LOAD:
            expected[plan.device_slots] = host_rows[plan.host_slots]
            ok &= torch.equal(dev_rows, expected)
        else:
            expected[plan.host_slots] = dev_rows[plan.device_slots]
            ok &= torch.equal(host_rows, expected)
    return bool(ok)


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """`[n, *row]` on any device as `[n, row_bytes]` uint8 on the CPU."""
    return rows.cpu().contiguous().view(torch.uint8).view(rows.shape[0], -1)


def _ceiling_gbps(cfg: BenchConfig, timer: Timer, nbytes: int, direction: Direction) -> float:
    """One contiguous copy of `nbytes` between pinned host memory and the device."""
    pin = cfg.device.type == "cuda"
    src_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst_dev = torch.empty(nbytes, dtype=torch.uint8, device=cfg.device)
    if direction is Direction.LOAD:
        op = lambda: dst_dev.copy_(src_host, non_blocking=True)  # noqa: E731
    else:
        op = lambda: src_host.copy_(dst_dev, non_blocking=True)  # noqa: E731
    ms = timer.median_ms(op, cfg.repeats, cfg.warmup, cfg.batch)
    return nbytes / ms / 1e6


def _metadata(cfg: BenchConfig, ceilings: dict[Direction, float], layer_bytes: int) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "spec": cfg.spec.name,
        "page_size": cfg.spec.page_size,
        "layout": cfg.layout.value,
        "tokens": cfg.tokens,
        "layer_bytes": layer_bytes,
        "churn_cycles": cfg.cycles,
        "timing": f"median of {cfg.repeats} x {cfg.batch} back-to-back calls (reference: 3 x 1)",
        "ceiling_gbps": {d.value: round(g, 2) for d, g in ceilings.items()},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(cfg.device),
    }
    if cfg.device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(cfg.device)
        meta["cuda"] = torch.version.cuda
    else:
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
