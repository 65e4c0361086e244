"""What every benchmark shares: the copy ceiling of this run, and where and when it ran."""

from __future__ import annotations

import datetime
import platform

import torch

from kvtier.pool.device import Direction


def ceiling_gbps(
    device: torch.device,
    nbytes: int,
    direction: Direction = Direction.LOAD,
    repeats: int = 10,
    warmup: int = 2,
    batch: int = 4,
) -> float:
    """One contiguous copy of `nbytes` between (pinned, on CUDA) host memory and `device`.

    Median of `repeats` samples of `batch` back-to-back copies (CUDA events on a
    stream of its own; the host clock on the CPU), as `kvtier bench transfer` times
    every path, so the two are comparable.
    """
    from kvtier.bench.transfer import Timer

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
