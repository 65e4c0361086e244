"""Executing transfer plans: layers host -> device (`load_layer`, `load_layers`) or back (`backup`).

Stream-ordered, reading no device value back (but the reference path), so a load can be submitted
layer by layer while the model runs; rows move as raw words, a layer's parts one after the other.
Contract: the caller orders a load after any backup writing the same host slots, and keeps the plan
alive until its stream has run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from kvtier.errors import PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.pool.rows import as_words, flat_words, rows_contiguous
from kvtier.spec import BufferSpec
from kvtier.transfer import cudart
from kvtier.transfer.parts import CopyPart, KernelPart, ReferencePart
from kvtier.transfer.plan import TransferPlan


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
    """Copy every buffer of `layers`, layer by layer, from the plan's host slots to its device slots."""
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


def _move_layers(
    plan: TransferPlan,
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    layers: list[int],
    stream: torch.cuda.Stream | None,
) -> None:
    """Every buffer of `layers`; a plan of the other direction, or for other pools, or a layer outside
    the model, is refused before anything moves."""
    if plan.direction is not direction:
        raise PlanError(f"plan is for {plan.direction.value}, not {direction.value}")
    if host_pool is not plan.host_pool or device_pool is not plan.device_pool:
        pools = f"{plan.host_pool} and {plan.device_pool}, not {host_pool} and {device_pool}"
        raise PlanError(f"the plan was built for {pools}")
    spec = host_pool.spec
    on = [(layer, spec.buffers_on(layer)) for layer in layers]
    if device_pool.device.type != "cuda":
        for layer, buffers in on:
            _layer(plan, buffers, layer, None)
        return
    stream = stream or torch.cuda.current_stream(device_pool.device)
    if plan.ready is not None:
        stream.wait_event(plan.ready)
    with torch.cuda.stream(stream):
        for layer, buffers in on:
            _layer(plan, buffers, layer, stream)


def _layer(
    plan: TransferPlan, buffers: list[BufferSpec], layer: int, stream: torch.cuda.Stream | None
) -> None:
    """One layer: each part in plan order, each of its buffers in the spec's order."""
    for part in plan.parts:
        for b in buffers:
            if b.name in part.buffers:
                _move(plan, part, b, layer, stream)


def _move(
    plan: TransferPlan,
    part: CopyPart | KernelPart | ReferencePart,
    b: BufferSpec,
    layer: int,
    stream: torch.cuda.Stream | None,
) -> None:
    """Buffer `b` of one layer, as `part` says."""
    host_pool, device_pool = plan.host_pool, plan.device_pool
    load = plan.direction is Direction.LOAD
    local = b.local_layer(layer)
    if isinstance(part, KernelPart):
        kb = part.by_buffer[b.name]
        launch = kb.launches[kb.layer_class[local]]
        views = functools.partial(kernel_views, plan, b, layer, launch.shape.word, load)
        launch.run(views, None if stream is None else stream.cuda_stream)
    elif isinstance(part, CopyPart) and part.batched:
        rb = part.run_bytes[b.name]
        host_ptrs = host_pool.region_ptrs(b.name)[local, rb.region] + rb.host
        dev_ptrs = int(device_pool.layer_ptrs(b.name)[local]) + rb.device
        if load:
            cudart.copy_runs(dev_ptrs, host_ptrs, rb.nbytes, stream)
        else:
            cudart.copy_runs(host_ptrs, dev_ptrs, rb.nbytes, stream)
    elif isinstance(part, CopyPart):
        _per_run(part, host_pool, as_words(device_pool.layer(b.name, layer)), b, layer, load)
    else:
        hs = plan.host_slots[part.positions]
        _reference(plan, device_pool.layer(b.name, layer), b, layer, hs, part.device_index)


def kernel_views(
    plan: TransferPlan, b: BufferSpec, layer: int, word: int, load: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(src, dst)` as 1-D words of `word` bytes from the kernel's bases: the first host region's first
    row of `layer`, and the device layer tensor."""
    host = flat_words(plan.host_pool.region_words(b.name, layer, 0), word)
    dev = flat_words(as_words(plan.device_pool.layer(b.name, layer)).view(-1), word)
    return (host, dev) if load else (dev, host)


def _per_run(
    part: CopyPart, host_pool: HostPool, dev_w: torch.Tensor, b: BufferSpec, layer: int, load: bool
) -> None:
    """One torch copy per joint run (each within one host segment)."""
    seg = host_pool.segment_slots
    runs = part.runs
    for host, device, length in zip(
        runs.host.tolist(), runs.device.tolist(), runs.length.tolist(), strict=True
    ):
        rows = host_pool.segment(b.name, layer, host // seg)
        host_w = as_words(rows[host % seg : host % seg + length])
        dev_rows = dev_w[device : device + length]
        if load:
            dev_rows.copy_(host_w, non_blocking=True)
        else:
            host_w.copy_(dev_rows, non_blocking=True)


def _reference(
    plan: TransferPlan,
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
    host_pool = plan.host_pool
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


def layer_calls(plan: TransferPlan, stream: torch.cuda.Stream | None) -> list[Callable[[], None]]:
    """One call per model layer, in order, that moves the layer on `stream` (the lane's, current when
    the calls run): what a lane runs with a signal after each; the first waits for the plan's uploads."""
    spec = plan.host_pool.spec
    calls: list[Callable[[], None]] = [
        functools.partial(_layer, plan, spec.buffers_on(layer), layer, stream)
        for layer in range(spec.num_layers)
    ]
    if stream is not None and plan.ready is not None and calls:
        first, ready = calls[0], plan.ready

        def waited() -> None:
            stream.wait_event(ready)
            first()

        calls[0] = waited
    return calls
