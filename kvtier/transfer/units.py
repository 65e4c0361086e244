"""The kernel's units: runs cut into equal pieces, as word offsets per buffer and host region.

A unit is `unit` consecutive rows, contiguous on the host and on the device side (device
slots, or rows of the staging buffer), that the row kernel moves as one row of `unit` times
the buffer's row bytes. A part's runs are cut into units of the largest divisor of every
run length within `KernelOptions.max_unit_bytes` of the part's widest row (whole pages
where slots are page-granular), so one launch per host region moves them all. Offsets are
uploaded once, by the plan's `Uploader`; `kernel_part` builds a `KernelPart` from joint runs,
`KernelStaging` the units of a staged part's host runs into or out of the staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostLayout, HostPool
from kvtier.spec import BufferSpec
from kvtier.transfer import kernel_args
from kvtier.transfer import launch as rules
from kvtier.transfer.options import KernelOptions
from kvtier.transfer.parts import (
    Buffers,
    KernelPart,
    KernelRegion,
    LayerTable,
    Uploader,
    Window,
    buffers_of,
    widest,
)


def kernel_part(
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    hn: np.ndarray,
    dn: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    opts: KernelOptions,
    up: Uploader,
    buffers: Buffers = None,
) -> KernelPart:
    """The kernel's units of joint runs (`starts`, `lens`: `[runs]` int64 positions in the plan's slot
    pairs `hn`, `dn`, `[n]` int64) for the named buffers, per host region, and their launches."""
    unit = unit_of(lens, opts, widest(host_pool.spec, buffers))
    run, offset = unit_heads(lens, unit)
    rows = starts[run] + offset
    chosen = buffers_of(host_pool.spec, buffers)
    regions = {
        b.name: unit_regions(direction, host_pool, device_pool, b, hn[rows], dn[rows], unit, opts, up)
        for b in chosen
    }
    tables = {}
    if host_pool.layout is HostLayout.PAGE_FIRST and unit == host_pool.spec.page_size:
        for b in chosen:
            table = _layer_table(device_pool, b.name, regions[b.name], opts, up)
            if table is not None:
                tables[b.name] = table
    return KernelPart(rows=int(lens.sum()), unit=unit, regions=regions, tables=tables)


@dataclass(frozen=True)
class KernelStaging:
    """How a staged part's host runs move through the kernel: in `direction` between `device_pool`'s
    staging buffer and the host, shaped by `opts`."""

    direction: Direction
    device_pool: DevicePool
    opts: KernelOptions

    def regions(
        self,
        host_pool: HostPool,
        host_at: np.ndarray,
        stage_row: np.ndarray,
        lens: np.ndarray,
        windows: tuple[Window, ...],
        buffers: Buffers,
        up: Uploader,
    ) -> tuple[dict[str, tuple[tuple[KernelRegion, ...], ...]], int]:
        """Per buffer name, per window, the units of the runs cut at windows (`host_at`, `stage_row`,
        `lens`: `[cuts]` int64, each cut's first host slot, first staging row and length), and the unit."""
        unit = unit_of(lens, self.opts, widest(host_pool.spec, buffers))
        cut, offset = unit_heads(lens, unit)
        host, stage = host_at[cut] + offset, stage_row[cut] + offset
        out = {}
        for b in buffers_of(host_pool.spec, buffers):
            per_window = []
            for w in windows:
                m = (cut >= w.first) & (cut < w.end)
                where = (host_pool, self.device_pool, b, host[m], stage[m], unit, self.opts, up)
                per_window.append(unit_regions(self.direction, *where))
            out[b.name] = tuple(per_window)
        return out, unit


def unit_regions(
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    b: BufferSpec,
    host_slots: np.ndarray,
    device_rows: np.ndarray,
    unit: int,
    opts: KernelOptions,
    up: Uploader,
) -> tuple[KernelRegion, ...]:
    """Units of buffer `b` starting at `host_slots` and `device_rows` (`[m]` int64 each: slots, and
    device slots or staging rows), grouped by host region, as word offsets with their launch."""
    device = device_pool.layer(b.name, b.layers[0]).device
    region, host_row = host_pool.locate(b.name, host_slots)
    out = []
    for r in np.unique(region).tolist():
        mask = region == r
        host_off = host_row[mask] * b.row_bytes
        dev_off = device_rows[mask] * b.row_bytes
        src, dst = (host_off, dev_off) if direction is Direction.LOAD else (dev_off, host_off)
        align = kernel_args.common_alignment(src, dst)  # bytes
        word = kernel_args.word_size(b.row_bytes * unit, [align])
        align_words = max(1, align // word)
        wide = _wide(host_off, b.row_bytes * unit)
        launch = opts.launch(b.row_bytes * unit, align_words * word, device, direction, wide)
        src, dst = up(torch.from_numpy(src // word)), up(torch.from_numpy(dst // word))
        out.append(KernelRegion(int(r), src, dst, align_words, word, launch, wide))
    return tuple(out)


def _wide(host_off: np.ndarray, unit_bytes: int) -> bool:
    """Whether units of `unit_bytes` at host byte offsets `host_off` (`[m]` int64, m > 0, in launch
    order) take the wide grid: their span, and the pieces they join into where one follows another."""
    pieces = 1 + int(np.count_nonzero(np.diff(host_off) != unit_bytes))
    span = int(host_off.max() - host_off.min()) + unit_bytes
    return rules.is_wide(span, len(host_off) * unit_bytes / pieces)


def unit_heads(lens: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each unit of runs of `lens` rows (`[k]` int64, each a multiple of `unit`) starts: its
    run's index and its offset in the run, `[m]` int64 each."""
    run = np.repeat(np.arange(len(lens)), lens // unit)
    offset = (np.arange(len(run)) - np.repeat(np.cumsum(lens // unit) - lens // unit, lens // unit)) * unit
    return run, offset


def unit_of(lens: np.ndarray, opts: KernelOptions, row_bytes: int) -> int:
    """The largest divisor of every run length (`[k]` int64) within `opts.max_unit_bytes` of rows of
    `row_bytes`."""
    cap = max(1, opts.max_unit_bytes // row_bytes)
    g = int(np.gcd.reduce(lens)) if len(lens) else 1
    for u in range(min(g, cap), 0, -1):
        if g % u == 0:
            return u
    return 1


def _layer_table(
    device_pool: DevicePool,
    buffer: str,
    regions: tuple[KernelRegion, ...],
    opts: KernelOptions,
    up: Uploader,
) -> LayerTable | None:
    """Each layer tensor's offset from the first in words, uploaded; None where layers cannot move
    together (one layer, no raw rows, regions in words of different widths, not whole words apart)."""
    ptrs = device_pool.layer_ptrs(buffer)
    words = {r.word for r in regions}
    if len(ptrs) < 2 or not device_pool.raw_rows(buffer) or len(words) != 1:
        return None
    word = words.pop()
    deltas = ptrs - ptrs[0]
    if np.any(deltas % word):
        return None
    return LayerTable(word, up(torch.from_numpy(deltas // word)), opts.sm_budget)
