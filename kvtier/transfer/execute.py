"""Executing transfer plans: layers host -> device (`load_layer`, `load_layers`) or back (`backup`).

Everything is stream-ordered and reads no device value back, so a load can be submitted
layer by layer while the model runs (but the reference mechanism waits for the stream).
Rows move as raw words (`as_words`), bit for bit, each part by its mechanism's executor
with what the plan computed. A buffer whose device tensors are not packed rows of its
dtype (a wrapped engine tensor) takes the reference path, for that buffer alone.

Overlap (`phases`, `KernelOptions.overlap`): a layer's direct kernel parts run on a second stream
(one per caller's stream, `streams.side_stream`), forked from the caller's after the parts that
must come first and joined before the layer ends, beside its other parts; the parts move disjoint
rows, and the host waits for nothing. A staged part whose buffers lie apart in the staging buffer
runs its device passes on a third stream beside its copies (`staged`); one on the second stream
(the kernel's units, `phases`) runs them on the second stream, after its copies.

Concurrency contract: the caller orders a load after any backup that writes the same host
slots, and keeps the plan alive until its stream has run. Plans with a staged part use the
device pool's staging buffer of their direction: two of them must not run at once on
different streams (the cache runs every load on one stream, every backup on another).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch

from kvtier.errors import PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.pool.rows import as_words, flat_words, rows_contiguous
from kvtier.spec import BufferSpec
from kvtier.transfer import groups, moves, phases, stacks, staged, streams
from kvtier.transfer.parts import CopyPart, KernelPart, Part, StackPart, StagedPart
from kvtier.transfer.plan import TransferPlan
from kvtier.transfer.runs import layer_spans


def load_layer(
    plan: TransferPlan,
    host_pool: HostPool,
    device_pool: DevicePool,
    layer: int,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy every buffer of model layer `layer` from the plan's host slots to its device slots."""
    load_layers(plan, host_pool, device_pool, [layer], stream)


def load_layers(
    plan: TransferPlan,
    host_pool: HostPool,
    device_pool: DevicePool,
    layers: Iterable[int],
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy every buffer of `layers` from the plan's host slots to its device slots (kernel units of
    consecutive layers in one launch where the host keeps them together: `groups`)."""
    _move_layers(plan, Direction.LOAD, host_pool, device_pool, list(layers), stream)


def backup(
    plan: TransferPlan,
    device_pool: DevicePool,
    host_pool: HostPool,
    layers: Iterable[int] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy every buffer of `layers` (all by default) from the plan's device slots to its host slots."""
    layers = range(host_pool.spec.num_layers) if layers is None else layers
    _move_layers(plan, Direction.BACKUP, host_pool, device_pool, list(layers), stream)


@contextlib.contextmanager
def _on_stream(
    plan: TransferPlan, device_pool: DevicePool, stream: torch.cuda.Stream | None
) -> Iterator[torch.cuda.Stream | None]:
    if device_pool.device.type != "cuda":
        yield None
        return
    stream = stream or torch.cuda.current_stream(device_pool.device)
    with torch.cuda.stream(stream):
        if plan.ready is not None:
            stream.wait_event(plan.ready)
        yield stream


def _move_layers(
    plan: TransferPlan,
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    layers: list[int],
    stream: torch.cuda.Stream | None,
) -> None:
    """Every buffer of `layers`, layer by layer, except kernel units that move several layers at once
    and stacks (`stacks`); a plan of the other direction, or for other pools, is refused before
    anything moves."""
    if plan.direction is not direction:
        raise PlanError(f"plan is for {plan.direction.value}, not {direction.value}")
    if host_pool is not plan.host_pool or device_pool is not plan.device_pool:
        pools = f"{plan.host_pool} and {plan.device_pool}, not {host_pool} and {device_pool}"
        raise PlanError(f"the plan was built for {pools}")
    spec = host_pool.spec
    # A layer outside the model raises here, before anything moves.
    on = [(layer, spec.buffers_on(layer)) for layer in layers]
    grouped = len(layers) > 1
    stacked = [p for p in plan.parts if isinstance(p, StackPart)]
    with _on_stream(plan, device_pool, stream) as s:
        split = plan.overlap if s is not None else None
        passes = streams.pass_stream(s) if s is not None and staged.passes_apart(plan) else None
        if passes is not None:
            streams.begin(s, passes)
        for layer, buffers in on:
            if split is None:
                for b in buffers:
                    _move(plan, plan.parts, host_pool, device_pool, b, layer, s, grouped)
            else:
                _overlapped(plan, split, host_pool, device_pool, buffers, layer, s, grouped)
            if passes is not None:
                streams.join(s, passes)
        if not (grouped or stacked):
            return
        for b in spec.buffers:
            present = set(b.layers)
            mine = [b.local_layer(layer) for layer in layers if layer in present]
            for part in plan.parts:
                if not (mine and b.name in part.buffers and device_pool.raw_rows(b.name)):
                    continue
                if isinstance(part, StackPart):
                    stacks.move(direction, part, host_pool, device_pool, b, mine, s)
                elif grouped and isinstance(part, KernelPart) and b.name in part.tables:
                    _kernel_groups(plan, part, host_pool, device_pool, b, mine)


def overlaps(plan: TransferPlan) -> bool:
    """Whether the plan's layers run their direct kernel parts beside their other parts (`phases`)."""
    return plan.device_pool.device.type == "cuda" and plan.overlap is not None


def _overlapped(
    plan: TransferPlan,
    split: phases.Phases,
    host_pool: HostPool,
    device_pool: DevicePool,
    buffers: Sequence[BufferSpec],
    layer: int,
    stream: torch.cuda.Stream,
    grouped: bool,
) -> None:
    """One layer as `split` says (`phases`); a buffer that takes the reference path moves once, on
    `stream`, as without overlap."""
    raw = [b for b in buffers if device_pool.raw_rows(b.name)]
    for b in buffers:
        if b not in raw:
            _move(plan, plan.parts, host_pool, device_pool, b, layer, stream, grouped)
    for b in raw:
        _move(plan, split.before, host_pool, device_pool, b, layer, stream, grouped)
    side = streams.side_stream(stream)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for b in raw:
            _move(plan, split.side, host_pool, device_pool, b, layer, side, grouped, on_side=True)
    for b in raw:
        _move(plan, split.beside, host_pool, device_pool, b, layer, stream, grouped)
    stream.wait_stream(side)


def _move(
    plan: TransferPlan,
    parts: Sequence[Part],
    host_pool: HostPool,
    device_pool: DevicePool,
    b: BufferSpec,
    layer: int,
    stream: torch.cuda.Stream | None,
    grouped: bool,
    on_side: bool = False,
) -> None:
    """Buffer `b` of one layer, each of `parts` (the plan's); with `grouped`, not the kernel parts that
    have a layer table for `b` (the caller moves those several layers at once). `on_side`: `stream` is
    the second stream, where staged parts run their device passes on `stream` itself."""
    dev = device_pool.layer(b.name, layer)
    if not device_pool.raw_rows(b.name):
        _reference(plan, host_pool, dev, b, layer, plan.host_slots, plan.device_slots.to(dev.device))
        return
    dev_w = as_words(dev)
    load = plan.direction is Direction.LOAD
    for part in parts:
        if b.name not in part.buffers or isinstance(part, StackPart):  # stacks: moved by the caller
            continue
        if isinstance(part, CopyPart):
            if part.batched:
                runs = part.run_bytes[b.name]
                moves.copy_runs(host_pool, b, layer, runs, dev_w.data_ptr(), load, stream, part.streams)
            else:
                _per_run(part, host_pool, dev_w, b, layer, load)
        elif isinstance(part, StagedPart) and not part.apart:
            staged.move(plan, part, host_pool, device_pool, [(b, dev_w)], layer, stream, on_side)
        elif isinstance(part, StagedPart):  # its buffers window by window, at the first one's turn
            on = [
                x
                for x in device_pool.spec.buffers_on(layer)
                if x.name in part.buffers and device_pool.raw_rows(x.name)
            ]
            if b.name == on[0].name:
                rows = [(x, as_words(device_pool.layer(x.name, layer))) for x in on]
                staged.move(plan, part, host_pool, device_pool, rows, layer, stream, on_side)
        elif isinstance(part, KernelPart):
            if not (grouped and b.name in part.tables):
                _kernel(plan, part, host_pool, dev_w, b, layer)
        else:
            _reference(plan, host_pool, dev, b, layer, plan.host_slots[part.positions], part.device_index)


def _per_run(
    part: CopyPart, host_pool: HostPool, dev_w: torch.Tensor, b: BufferSpec, layer: int, load: bool
) -> None:
    """One torch copy per joint run (each within one host segment)."""
    seg = host_pool.segment_slots
    for host, device, length in part.runs.triples:
        rows = host_pool.segment(b.name, layer, host // seg)
        host_w = as_words(rows[host % seg : host % seg + length])
        dev_rows = dev_w[device : device + length]
        if load:
            dev_rows.copy_(host_w, non_blocking=True)
        else:
            host_w.copy_(dev_rows, non_blocking=True)


def _kernel(
    plan: TransferPlan, part: KernelPart, host_pool: HostPool, dev_w: torch.Tensor, b: BufferSpec, layer: int
) -> None:
    """The row kernel over the part's units, one launch per host region in the shape the plan gave it."""
    moves.kernel_regions(plan.direction, part.regions[b.name], part.unit, host_pool, dev_w, b, layer)


def _kernel_groups(
    plan: TransferPlan,
    part: KernelPart,
    host_pool: HostPool,
    device_pool: DevicePool,
    b: BufferSpec,
    local: list[int],
) -> None:
    """The kernel's units of buffer `b` on local layers `local`: each group of consecutive layers (up
    to `groups.GROUP_TILE_BYTES` of a unit's stack) in one launch per host region."""
    table = part.tables[b.name]
    word = table.word
    unit_bytes = b.row_bytes * part.unit
    most = max(1, groups.GROUP_TILE_BYTES // unit_bytes)
    first = flat_words(as_words(device_pool.layer(b.name, b.layers[0])).view(-1), word)
    load = plan.direction is Direction.LOAD
    for lo, hi in layer_spans(local, most):
        if hi - lo == 1:
            dev_w = as_words(device_pool.layer(b.name, b.layers[lo]))
            _kernel(plan, part, host_pool, dev_w, b, b.layers[lo])
            continue
        layers = [
            flat_words(as_words(device_pool.layer(b.name, b.layers[j])).view(-1), word) for j in range(lo, hi)
        ]
        for region in part.regions[b.name]:
            # Units' host offsets count from a region's first row of a layer: from the first
            # layer's (the region's start), shifted by `lo` layers of a page (one unit each).
            packed = flat_words(host_pool.region_words(b.name, b.layers[0], region.region), word)
            packed_off, split_off = (region.src, region.dst) if load else (region.dst, region.src)
            groups.copy_groups(
                packed,
                packed_off,
                layers,
                split_off,
                unit_bytes // word,
                plan.direction,
                packed_shift=lo * (unit_bytes // word),
                table=(first, table.offsets[lo:hi]),
                sm_budget=table.programs,
                validate=False,
                offsets_align=region.align,
            )


def _reference(
    plan: TransferPlan,
    host_pool: HostPool,
    dev: torch.Tensor,
    b: BufferSpec,
    layer: int,
    host_slots: torch.Tensor,
    index: torch.Tensor,
) -> None:
    """Per-token gather and scatter through host memory, the path every other one must equal:
    `host_slots` `[m]` int64 CPU, `index` `[m]` int64 on `dev`'s device (their device slots)."""
    n = host_slots.numel()
    if n == 0:
        return
    fast = dev.dtype == b.dtype and rows_contiguous(dev)
    if plan.direction is Direction.LOAD:
        rows = host_pool.gather(b.name, layer, host_slots)
        if fast:
            as_words(dev).index_copy_(0, index, as_words(rows).to(dev.device))
        else:
            dev[index] = rows.to(dev.device).to(dev.dtype)
    else:
        if fast:
            # `.cpu()` waits for the stream: the reference path is synchronous.
            words = as_words(dev).index_select(0, index).cpu()
            rows = words.view(torch.uint8).view(b.dtype).view(n, *b.row_shape)
        else:
            rows = dev[index].cpu().to(b.dtype)
        host_pool.scatter(b.name, layer, host_slots, rows)
