"""Executing a staged part (`StagedPart`) for one layer: host runs through the device pool's staging
buffer of the plan's direction, window by window (`move`).

A load copies a window's host runs into the staging buffer (the copy engine, or the kernel's units)
and places the rows on their device slots with one `index_copy_`; a backup gathers them with one
`index_select` and copies them out. A window's buffers go in the part's order (`StagedPart.order`).

Where the part's buffers lie apart in the staging buffer (`StagedPart.apart`) and the plan overlaps
(`passes_apart`), the device passes run on the pass stream (`streams.pass_stream`):
- a load's `index_copy_` of each buffer after its rows arrive, while the next buffer's arrive;
- a backup's `index_select` of all of a window's buffers at once, each buffer's copies out waiting
  for its own gather only, so that the next buffers' gathers run while the first is copied out.
Each stream waits for the other's reads of a place before it writes there (`streams.reuse`); the
executor joins the pass stream into the layer's stream when the layer ends.

Why: one after the other on one stream, a layer's passes (`glm-5`: 95 + 25 us of a ~3.2 ms layer)
leave the copy engine idle (bench/FINDINGS.md, "Overlapped parts").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.spec import BufferSpec
from kvtier.transfer import moves, streams
from kvtier.transfer.parts import StagedPart, Window

if TYPE_CHECKING:
    from kvtier.transfer.plan import TransferPlan

# A buffer's staging rows (`[rows, W]` words) and its place: `[start, end)` raw addresses.
_Stage = tuple[torch.Tensor, tuple[int, int]]


def move(
    plan: TransferPlan,
    part: StagedPart,
    host_pool: HostPool,
    device_pool: DevicePool,
    rows: Sequence[tuple[BufferSpec, torch.Tensor]],
    layer: int,
    stream: torch.cuda.Stream | None,
    on_side: bool = False,
) -> None:
    """Buffers `rows` (each with its device rows as words, `[slots, W]`) of one layer through the
    staging buffer, window by window (the module docstring); `on_side`: `stream` is the layer's
    second stream (`phases`), where every pass runs on `stream` itself."""
    load = plan.direction is Direction.LOAD
    apart = stream is not None and not on_side and passes_apart(plan)
    passes = streams.pass_stream(stream) if apart else None
    rows = sorted(rows, key=lambda x: part.order.index(x[0].name))
    stages = [_stage(part, device_pool, plan.direction, b, dev_w) for b, dev_w in rows]
    index = part.device_index
    for w, (lo, hi, first, end) in enumerate(part.windows):
        window = Window(lo, hi, first, end)
        if passes is not None and not load:
            _gather_ahead(plan, part, host_pool, rows, stages, layer, w, window, stream, passes)
            continue
        for (b, dev_w), (stage, place) in zip(rows, stages, strict=True):
            if passes is None:
                if not load:
                    torch.index_select(dev_w, 0, index[lo:hi], out=stage[: hi - lo])
                _fill(plan, part, host_pool, stage, b, layer, w, window, stream)
                if load:
                    dev_w.index_copy_(0, index[lo:hi], stage[: hi - lo])
                continue
            streams.reuse(stream, place)
            _fill(plan, part, host_pool, stage, b, layer, w, window, stream)
            passes.wait_stream(stream)
            with torch.cuda.stream(passes):
                dev_w.index_copy_(0, index[lo:hi], stage[: hi - lo])
            streams.reading(stream, place, passes)


def _stage(
    part: StagedPart, device_pool: DevicePool, direction: Direction, b: BufferSpec, dev_w: torch.Tensor
) -> _Stage:
    """Buffer `b`'s place in the staging buffer, as `[window_rows, W]` words of `dev_w`'s dtype."""
    at, cap = part.stage_at[b.name], part.window_rows
    raw = device_pool.staging(direction)[at : at + cap * b.row_bytes]
    return raw.view(dev_w.dtype).view(cap, dev_w.shape[1]), (raw.data_ptr(), raw.data_ptr() + raw.numel())


def _gather_ahead(
    plan: TransferPlan,
    part: StagedPart,
    host_pool: HostPool,
    rows: Sequence[tuple[BufferSpec, torch.Tensor]],
    stages: Sequence[_Stage],
    layer: int,
    w: int,
    window: Window,
    stream: torch.cuda.Stream,
    passes: torch.cuda.Stream,
) -> None:
    """A backup's window `w` with its buffers apart: every buffer's gather on `passes` first, then each
    buffer's copies out on `stream` after its own gather."""
    index = part.device_index[window.lo : window.hi]
    gathered = []
    for (_, dev_w), (stage, place) in zip(rows, stages, strict=True):
        streams.reuse(stream, place, passes)
        with torch.cuda.stream(passes):
            torch.index_select(dev_w, 0, index, out=stage[: len(index)])
        done = torch.cuda.Event()
        done.record(passes)
        gathered.append(done)
    for (b, _), (stage, place), done in zip(rows, stages, gathered, strict=True):
        stream.wait_event(done)
        _fill(plan, part, host_pool, stage, b, layer, w, window, stream)
        streams.reading(stream, place, stream)


def _fill(
    plan: TransferPlan,
    part: StagedPart,
    host_pool: HostPool,
    stage: torch.Tensor,
    b: BufferSpec,
    layer: int,
    w: int,
    window: Window,
    stream: torch.cuda.Stream | None,
) -> None:
    """Window `w`'s host runs of `b` between the host and `stage` (`[rows, W]` words)."""
    load, run_bytes = plan.direction is Direction.LOAD, part.run_bytes[b.name]
    if part.kernel is not None:
        regions = part.kernel[b.name][w]
        moves.kernel_regions(plan.direction, regions, part.unit, host_pool, stage.view(-1), b, layer)
    elif part.batched:
        runs = (x[window.first : window.end] for x in run_bytes)
        moves.copy_runs(host_pool, b, layer, runs, stage.data_ptr(), load, stream, part.streams)
    else:  # one torch copy per run
        flat = stage.view(-1)
        size = flat.element_size()
        for r, h, st, n in zip(*(x[window.first : window.end].tolist() for x in run_bytes), strict=True):
            host_w = host_pool.region_words(b.name, layer, r)[h // size : (h + n) // size]
            stage_w = flat[st // size : (st + n) // size]
            if load:
                stage_w.copy_(host_w, non_blocking=True)
            else:
                host_w.copy_(stage_w, non_blocking=True)


def passes_apart(plan: TransferPlan) -> bool:
    """Whether the plan's staged parts run their device passes on the pass stream (`move`): on CUDA,
    with `KernelOptions.overlap`, where some staged part's buffers lie apart."""
    return (
        plan.kernel.overlap
        and plan.device_pool.device.type == "cuda"
        and any(isinstance(p, StagedPart) and p.apart for p in plan.parts)
    )
