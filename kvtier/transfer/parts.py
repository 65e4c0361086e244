"""The parts of a plan, one small type per mechanism, and how each is built from runs.

`CopyPart`: joint runs the copy engine moves, in bytes per buffer; `KernelPart`: units of joint runs
the row kernel moves, a launch per buffer and layer class; `ReferencePart`: rows token by token.
The kernel reads a layer's host regions from one base, the first region's first row: a row's offset
is its region's distance from that base (`HostPool.region_classes`) plus its row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.spec import BufferSpec
from kvtier.transfer import kernels, rule
from kvtier.transfer.options import KernelOptions, TransferPath
from kvtier.transfer.runs import RunTable

Upload = Callable[[torch.Tensor], torch.Tensor]


class RunBytes(NamedTuple):
    """One buffer's runs in bytes, `[k]` int64 each: host region, offset in it, device offset in the
    layer tensor, and length."""

    region: np.ndarray
    host: np.ndarray
    device: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class CopyPart:
    """Joint runs the copy engine moves: one batched call per buffer and layer (`batched`), else one
    torch copy per run; the compiled loop spreads the layers over `streams` streams."""

    mechanism: ClassVar[TransferPath] = TransferPath.COPY
    rows: int
    runs: RunTable
    run_bytes: dict[str, RunBytes]
    batched: bool
    streams: int

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.run_bytes)


@dataclass(frozen=True)
class KernelBuffer:
    """One buffer's kernel launches, of units of `unit` rows: `launches[c]` serves the layers whose
    `layer_class[local]` is c."""

    unit: int
    launches: tuple[kernels.RowLaunch, ...]
    layer_class: np.ndarray


@dataclass(frozen=True)
class KernelPart:
    """Joint runs cut into units that the row kernel moves, per buffer name."""

    mechanism: ClassVar[TransferPath] = TransferPath.KERNEL
    rows: int
    by_buffer: dict[str, KernelBuffer]

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.by_buffer)

    @property
    def programs(self) -> int:
        """The widest grid of its launches: SMs it holds while it runs."""
        return max(
            (launch.shape.grid(launch.n) for k in self.by_buffer.values() for launch in k.launches), default=0
        )


@dataclass(frozen=True)
class ReferencePart:
    """Rows moved token by token: `positions` (`[m]` int64 CPU) in the plan's pairs, `device_index`
    their device slots (`[m]` int64 on the device)."""

    mechanism: ClassVar[TransferPath] = TransferPath.REFERENCE
    rows: int
    buffers: frozenset[str]
    positions: torch.Tensor
    device_index: torch.Tensor


Part = CopyPart | KernelPart | ReferencePart


def copy_part(
    host_pool: HostPool, runs: RunTable, buffers: list[BufferSpec], batched: bool, streams: int
) -> CopyPart:
    """Copy-engine copies of joint `runs` of `buffers`, with their bytes per buffer."""
    out = {}
    for b in buffers:
        region, row = host_pool.locate(b.name, runs.host)
        r = b.row_bytes
        out[b.name] = RunBytes(region, row * r, runs.device * r, runs.length * r)
    return CopyPart(int(runs.length.sum()), runs, out, batched, streams)


def kernel_part(
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    host_at: np.ndarray,
    dev_at: np.ndarray,
    lens: np.ndarray,
    buffers: list[BufferSpec],
    opts: KernelOptions,
    upload: Upload,
) -> KernelPart:
    """The kernel's units of joint runs (`host_at`, `dev_at`, `lens`: `[k]` int64 first host slot,
    first device slot, length) for `buffers`, each cut into units of its own rows (`rule.unit_rows`)."""
    by_buffer = {}
    for b in buffers:
        unit = rule.unit_rows(lens, b.row_bytes, opts.max_unit_bytes)
        counts = lens // unit
        run = np.repeat(np.arange(len(lens)), counts)
        offset = (np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)) * unit
        hosts, devs = host_at[run] + offset, dev_at[run] + offset
        by_buffer[b.name] = _kernel_buffer(
            direction, host_pool, device_pool, b, hosts, devs, unit, opts, upload
        )
    return KernelPart(int(lens.sum()), by_buffer)


def _kernel_buffer(
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    b: BufferSpec,
    hosts: np.ndarray,
    devs: np.ndarray,
    unit: int,
    opts: KernelOptions,
    upload: Upload,
) -> KernelBuffer:
    """Launches of units starting at host slots `hosts` and device slots `devs` (`[m]` int64) of `b`."""
    r, unit_bytes = b.row_bytes, b.row_bytes * unit
    region, row = host_pool.locate(b.name, hosts)
    ptrs = host_pool.region_ptrs(b.name)  # [layers, regions]
    classes, layer_class = host_pool.region_classes(b.name)
    host_offs = [apart[region] + row * r for apart in classes]
    dev_off = devs * r
    load = direction is Direction.LOAD
    bases = [int(a) for a in ptrs[:, 0]] + [int(a) for a in device_pool.layer_ptrs(b.name)]
    align = kernels.common_alignment(dev_off, *host_offs)
    launch = opts.launch(unit_bytes, align, device_pool.device, direction, _wide(host_offs[0], unit_bytes))
    out = []
    for host_off in host_offs:
        src, dst = (host_off, dev_off) if load else (dev_off, host_off)
        shape = (launch.programs, launch.rows, launch.stages)
        out.append(
            kernels.prepare_rows(unit_bytes, src, dst, bases, load, device_pool.device, *shape, upload)
        )
    return KernelBuffer(unit, tuple(out), layer_class)


def _wide(host_off: np.ndarray, unit_bytes: int) -> bool:
    """Whether units of `unit_bytes` at host byte offsets `host_off` (`[m]` int64, in launch order) take
    the wide grid (`kernels.is_wide`): their span, and the pieces they join into."""
    if not len(host_off):
        return False
    pieces = 1 + int(np.count_nonzero(np.diff(host_off) != unit_bytes))
    span = int(host_off.max() - host_off.min()) + unit_bytes
    return kernels.is_wide(span, len(host_off) * unit_bytes / pieces)


def reference_part(
    positions: torch.Tensor, device_slots: torch.Tensor, buffers: frozenset[str], upload: Upload
) -> ReferencePart:
    """Token-by-token moves of the pairs at `positions` (`[m]` int64 CPU) of `buffers`."""
    return ReferencePart(int(positions.numel()), buffers, positions, upload(device_slots[positions]))
