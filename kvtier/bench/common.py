"""What every benchmark shares: its timer, the copy ceiling of the run, where and when it ran,
and releasing one configuration's memory before the next is built.

A benchmark that measures several configurations in one process builds one, measures
it, closes it (`close` below) and drops every reference to it, then calls `collect`:
two configurations of a long prefix do not fit the host's memory at once.
"""

from __future__ import annotations

import datetime
import gc
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.pool import DevicePool
from kvtier.pool.device import Direction
from kvtier.transfer.probe import HOLD_CYCLES, held_times

Progress = Callable[[str], None]


def quiet(_msg: str) -> None:
    """A progress reporter that says nothing."""


class Timer:
    """Median milliseconds of a callable: CUDA events on `stream`, or the host clock on CPU."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device, self.stream = device, stream

    def median_ms(self, fn: Callable[[], None], repeats: int, warmup: int, batch: int = 1) -> float:
        """Median over `repeats` of the time of `batch` back-to-back calls, divided by `batch`.

        Back-to-back calls time a layer as a multi-layer load runs it: the host issues
        the next layer while the previous one still moves. On CUDA the stream is held
        by a short GPU sleep while the calls are issued, so the window starts with work
        queued, as in the middle of a load, not with the first call's host cost.
        """
        for _ in range(warmup):
            fn()
        times = []
        if self.device.type != "cuda":
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / batch)
            return statistics.median(times)
        stream = self.stream or torch.cuda.current_stream(self.device)
        return held_times(stream, fn, repeats, batch, HOLD_CYCLES)[0] * 1e3

    def issue_ms(self, fn: Callable[[], None], repeats: int = 3) -> float:
        """Median host milliseconds to issue one call of `fn`: on CUDA while a GPU sleep holds the
        stream, so no call waits for the device (what a reload's host pays per layer whether or not
        the GPU keeps up); on CPU the call itself."""
        if self.device.type == "cuda":
            stream = self.stream or torch.cuda.current_stream(self.device)
            return held_times(stream, fn, repeats, 1, HOLD_CYCLES)[1] * 1e3
        return self.median_ms(fn, repeats, 0)


def ceiling_gbps(
    device: torch.device,
    nbytes: int,
    direction: Direction = Direction.LOAD,
    repeats: int = 10,
    warmup: int = 2,
    batch: int = 4,
) -> float:
    """One contiguous copy of `nbytes` between (pinned, on CUDA) host memory and `device`.

    Median of `repeats` samples of `batch` back-to-back copies, timed as `kvtier bench
    transfer` times every path, so the two are comparable.
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    if direction is Direction.LOAD:
        op = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
    else:
        op = lambda: host.copy_(dev, non_blocking=True)  # noqa: E731
    ms = Timer(device, stream).median_ms(op, repeats, warmup, batch)
    return nbytes / ms / 1e6


def environment(device: torch.device) -> dict:
    """Date, versions and the machine: the header of every JSON result."""
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
    else:
        meta["cpu"] = platform.processor() or platform.machine()
    return meta


@dataclass
class OpStat:
    """Host time of one operation over a run, in microseconds."""

    op: str
    calls: int
    median_us: float
    p99_us: float
    max_us: float


def op_stat(op: str, seconds: Sequence[float]) -> OpStat:
    """Median, p99 and maximum of `seconds` (one per call), in microseconds."""
    if not seconds:
        return OpStat(op, 0, 0.0, 0.0, 0.0)
    us = np.asarray(seconds) * 1e6
    return OpStat(
        op,
        len(us),
        round(float(np.median(us)), 2),
        round(float(np.percentile(us, 99)), 2),
        round(float(us.max()), 2),
    )


def write_random_kv(pool: DevicePool, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes in every buffer and layer of `slots` (`[n]` int64), as a forward pass would write."""
    if not len(slots):
        return
    idx = slots.to(pool.device)
    for b in pool.spec.buffers:
        for layer in b.layers:
            raw = torch.randint(
                0, 256, (len(slots), b.row_bytes), dtype=torch.uint8, device=pool.device, generator=gen
            )
            pool.layer(b.name, layer)[idx] = raw.view(b.dtype).view(len(slots), *b.row_shape)


def close(*objs: object) -> None:
    """Close each object that can be closed (an engine, a cache, a pool), returning its memory now."""
    for obj in objs:
        closer = getattr(obj, "close", None)
        if callable(closer):
            closer()


def collect() -> None:
    """Collect what the caller dropped and give back cached device and pinned host memory.

    Call it once the last reference to a configuration is gone: objects in reference
    cycles (a cache and its lanes) are freed only by the collector, and torch keeps
    freed pinned and device blocks cached for reuse until asked to return them.
    """
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host is not None:
            empty_host()
