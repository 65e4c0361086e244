"""What an operation hands the compiled loop (`native`): the pools' addresses, once per pool pair
(`Buffers`), and per operation each buffer's copies and kernel launches (`Work`), from run lists
(`copies_work`) or from a plan whose every part the loop can make (`plan_work`); `run_work` submits.

A copy-only operation of short runs goes out over `copy_streams` streams, layer l on the l-th (each
copy's fixed cost overlaps the others'); one with a kernel launch stays on one stream.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.errors import InvariantError, PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.transfer import cudart
from kvtier.transfer.execute import kernel_views
from kvtier.transfer.native import Job, Native
from kvtier.transfer.parts import CopyPart, KernelBuffer, KernelPart
from kvtier.transfer.plan import RunCopies, TransferPlan


class Buffers:
    """Every buffer of a pool pair as `kvtier_run_layers` addresses its rows (`HostPool.row_map`, host
    `[buffer layers, regions]` and device `[buffer layers]` int64 addresses), built once per pair."""

    class _Row(ctypes.Structure):
        _fields_ = [
            *((f, ctypes.c_int64) for f in ("row_bytes", "region_slots", "page", "page_rows", "regions")),
            *((f, ctypes.c_void_p) for f in ("host", "device", "local")),
        ]

    def __init__(self, host_pool: HostPool, device_pool: DevicePool) -> None:
        spec = host_pool.spec
        self.host_pool, self.device_pool, self.layers = host_pool, device_pool, spec.num_layers
        self.index = {b.name: i for i, b in enumerate(spec.buffers)}
        self.buffer_layers = [len(b.layers) for b in spec.buffers]
        self._keep: list[np.ndarray] = []
        self._rows = (self._Row * len(spec.buffers))()
        for row, b in zip(self._rows, spec.buffers, strict=True):
            on = list(b.layers)
            host = np.ascontiguousarray(host_pool.region_ptrs(b.name), dtype=np.int64)
            device = np.ascontiguousarray(device_pool.layer_ptrs(b.name), dtype=np.int64)
            local = np.full(self.layers, -1, dtype=np.int64)
            local[on] = np.arange(len(on))
            if host.shape[0] != len(on) or device.shape != (len(on),):
                raise InvariantError(
                    f"a buffer on {len(on)} layers has host {host.shape}, device {device.shape} addresses"
                )
            self._keep += (host, device, local)
            row.row_bytes, row.regions = b.row_bytes, host.shape[1]
            row.region_slots, row.page, row.page_rows = host_pool.row_map(b.name)
            row.host, row.device, row.local = host.ctypes.data, device.ctypes.data, local.ctypes.data
        self.address = ctypes.addressof(self._rows)
        self.count = len(spec.buffers)

    def check(self, host_pool: HostPool, device_pool: DevicePool) -> None:
        """Refuse work planned for other pools than these addresses'."""
        if host_pool is not self.host_pool or device_pool is not self.device_pool:
            raise PlanError(
                f"the work was planned for {host_pool} and {device_pool}, the buffers hold the addresses "
                f"of {self.host_pool} and {self.device_pool}"
            )


def run_buffers(host_pool: HostPool, device_pool: DevicePool) -> Buffers | None:
    """The pools' buffers as the loop addresses them, or None where some buffer cannot take raw copies."""
    if cudart.dma_mode() is cudart.DmaMode.TORCH or not all(
        device_pool.raw_rows(b.name) for b in host_pool.spec.buffers
    ):
        return None
    return Buffers(host_pool, device_pool)


class _Launch(ctypes.Structure):
    """`kvtier_launch`."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        *((f, ctypes.c_int64) for f in ("grid", "threads", "shared", "src_off", "dst_off", "n")),
        *((f, ctypes.c_int64) for f in ("row_vecs", "n_bytes", "vecs_bytes", "extra")),
    ]


class _Work(ctypes.Structure):
    """`kvtier_work`."""

    _fields_ = [
        ("runs", ctypes.c_void_p),
        ("n_runs", ctypes.c_int64),
        ("launches", ctypes.c_void_p),
        ("layer_class", ctypes.c_void_p),
    ]


@dataclass
class Work:
    """One operation's calls, a `_Work` per buffer of the pools in the spec's order, the streams its
    layers go out on, the most runs one buffer copies and the copies of all layers; `keep` holds the
    arrays they point into."""

    rows: Any
    streams: int = 1
    most_runs: int = 0
    copies: int = 0
    keep: list[Any] = field(default_factory=list)

    def copy(self, index: int, runs: np.ndarray, layers: int) -> None:
        """Buffer `index` copies `runs` (`[3, k]` int64 C-contiguous: first host slot, first device
        slot, length) on each of its `layers` layers."""
        self.keep.append(runs)
        self.rows[index].runs, self.rows[index].n_runs = runs.ctypes.data, runs.shape[1]
        self.most_runs = max(self.most_runs, runs.shape[1])
        self.copies += runs.shape[1] * layers

    def takes(self, lib: Native) -> bool:
        """Whether `lib` can make these calls (a buffer of more runs than `cudart.small_batch()` needs the
        batched call)."""
        return self.most_runs <= cudart.small_batch() or lib.has_batch


def copies_work(copies: RunCopies, buffers: Buffers) -> Work:
    """Every buffer copies the joint runs of `copies`."""
    buffers.check(copies.host_pool, copies.device_pool)
    work = Work((_Work * buffers.count)(), copies.streams)
    runs = np.ascontiguousarray(copies.joint[1:])
    for i in range(buffers.count):
        work.copy(i, runs, buffers.buffer_layers[i])
    return work


def plan_work(plan: TransferPlan, buffers: Buffers, lib: Native) -> Work | None:
    """The loop's calls for `plan`, or None where some part is not the loop's to make: the reference
    path, unbatched copies, or a kernel launch it cannot make (`Native.kernel`)."""
    buffers.check(plan.host_pool, plan.device_pool)
    work = Work((_Work * buffers.count)())
    kernel = False
    for part in plan.parts:
        if isinstance(part, CopyPart) and part.batched:
            runs = np.ascontiguousarray(part.runs.table[1:])
            for i in map(buffers.index.__getitem__, part.buffers):
                work.copy(i, runs, buffers.buffer_layers[i])
            work.streams = max(work.streams, part.streams)
        elif isinstance(part, KernelPart) and lib.kernel is not None:
            kernel = True
            for name, kb in part.by_buffer.items():
                found = _launches(plan, name, kb, lib.kernel)
                if found is None:
                    return None
                launches, classes = found
                work.keep += (launches, classes)
                row = work.rows[buffers.index[name]]
                row.launches, row.layer_class = ctypes.addressof(launches), classes.ctypes.data
        else:
            return None
    if kernel:
        work.streams = 1
    return work


def _launches(plan: TransferPlan, name: str, kb: KernelBuffer, find) -> tuple[Any, np.ndarray] | None:
    """A `_Launch` per class of layers of `kb` (buffer `name`) alike in their launch and in their bases'
    16-byte alignment (which Triton compiles into the kernel), and each buffer layer's class
    (`[layers]` int64); None where `find` has no compiled kernel for one."""
    b = plan.host_pool.spec.buffer(name)
    load = plan.direction is Direction.LOAD
    hosts, devs = plan.host_pool.region_ptrs(name)[:, 0], plan.device_pool.layer_ptrs(name)
    src, dst = (hosts, devs) if load else (devs, hosts)
    keys = kb.layer_class * 4 + (src % 16 == 0) * 2 + (dst % 16 == 0)
    kinds, classes = np.unique(keys, return_inverse=True)
    out = (_Launch * len(kinds))()
    for i, (key, row) in enumerate(zip(kinds.tolist(), out, strict=True)):
        c, src_aligned, dst_aligned = key // 4, key & 2, key & 1
        launch, shape = kb.launches[c], kb.launches[c].shape
        layer = b.layers[int(np.argmax(classes == i))]
        views = functools.partial(kernel_views, plan, b, layer, shape.word, load)
        found = find(launch, views, (bool(src_aligned), bool(dst_aligned)))
        if found is None:
            return None
        row.func, row.threads, row.shared = found.func, found.threads, found.shared
        row.grid, row.n, row.row_vecs = shape.grid(launch.n), launch.n, shape.row_vecs
        row.src_off, row.dst_off = launch.src_off.data_ptr(), launch.dst_off.data_ptr()
        row.n_bytes, row.vecs_bytes, row.extra = found.n_bytes, found.vecs_bytes, found.extra
    return out, np.ascontiguousarray(classes.reshape(-1), dtype=np.int64)


def run_work(
    lib: Native,
    work: Work,
    buffers: Buffers,
    direction: Direction,
    current: int,
    order: int,
    events: list[int],
    streams: list[int],
    forks: list[int],
    device: int | None = None,
) -> Job | None:
    """Submit `work` from the loop, layer l on `streams[l % k]`, after ordering `streams[0]` behind raw
    stream `current` with raw event `order` (where set); `events`: one raw event per model layer,
    recorded after it, or one at the end; `forks`: a raw event per stream (`CudaLane.run_native`).
    With `device`, from a thread of the loop's own: its `Job`, or None where none started."""
    load = direction is Direction.LOAD
    at = ctypes.addressof(work.rows)
    where = (buffers.address, buffers.count, buffers.layers, load, events, streams, forks, (order, current))
    job = lib.run(at, *where, cudart.small_batch(), device)
    if job is not None:
        job.keep += (work, buffers)
    return job
