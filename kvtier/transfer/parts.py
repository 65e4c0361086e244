"""The parts of a plan: one type per mechanism, each with only what its executor reads.

- `CopyPart`: joint runs the copy engine moves straight between host and device slots;
- `StagedPart`: host runs through a device staging buffer, placed on their scattered
  device slots on the device (loads), or the reverse (backups);
- `KernelPart`: units the Triton kernels gather or scatter, each launch's shape computed
  here, once;
- `ReferencePart`: per-token gather and scatter through host memory.

The builders turn runs (`runs`) into parts; every index a part needs on the device is
uploaded once, by the plan's `Uploader`. Byte offsets on the host count from a region's
first row of a layer (`HostPool.locate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostLayout, HostPool
from kvtier.spec import KVSpec
from kvtier.transfer import kernel_args
from kvtier.transfer.launch import KernelLaunch
from kvtier.transfer.options import KernelOptions, Mechanism, PathCosts, TransferPath
from kvtier.transfer.runs import RunTable


class RunBytes(NamedTuple):
    """One buffer's runs in bytes, `[k]` int64 each: host region, offset in it, device offset (in the
    layer tensor or the staging buffer) and length."""

    region: np.ndarray
    host: np.ndarray
    device: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class CopyPart:
    """Joint runs the copy engine moves: one batched call per buffer and layer (`batched`, over
    `streams` streams, from `run_bytes` per buffer name), else one torch copy per run."""

    mechanism: ClassVar[Mechanism] = Mechanism.COPY
    rows: int
    runs: RunTable
    run_bytes: dict[str, RunBytes]
    batched: bool
    streams: int


class Window(NamedTuple):
    """One fill of the staging buffer: part rows `[lo, hi)`, moved by the part's runs `[first, end)`."""

    lo: int
    hi: int
    first: int
    end: int


@dataclass(frozen=True)
class StagedPart:
    """Host runs cut where a window ends (`device`: a run's first staging row; in bytes per buffer:
    `run_bytes`), through the staging buffer to `device_index` (`[rows]` int64 on the device)."""

    mechanism: ClassVar[Mechanism] = Mechanism.STAGED
    rows: int
    runs: RunTable
    run_bytes: dict[str, RunBytes]
    windows: tuple[Window, ...]
    device_index: torch.Tensor
    batched: bool
    streams: int


@dataclass(frozen=True)
class KernelRegion:
    """The kernel's units of one buffer in one host region, and their `launch`: `src`/`dst` `[m]`
    int64 word offsets on the device (swapped for backups), in words of `word` bytes (the widest
    the unit and every offset allow), all multiples of `align` words (a power of two)."""

    region: int
    src: torch.Tensor
    dst: torch.Tensor
    align: int
    word: int
    launch: KernelLaunch


@dataclass(frozen=True)
class LayerTable:
    """Where a buffer's layer tensors lie, so that several layers of its units move in one launch:
    `offsets` `[layers]` int64 on the device, from the first layer's, in words of `word` bytes;
    `programs`: the launch's grid."""

    word: int
    offsets: torch.Tensor
    programs: int


@dataclass(frozen=True)
class KernelPart:
    """Units of `unit` rows (each contiguous on both sides) that the Triton kernel moves: per buffer
    name, its units per host region (`regions`) and, where they are contiguous across layers on
    the host (`page_first`, whole pages), its `LayerTable` (`tables`)."""

    mechanism: ClassVar[Mechanism] = Mechanism.KERNEL
    rows: int
    unit: int
    regions: dict[str, tuple[KernelRegion, ...]]
    tables: dict[str, LayerTable]

    @property
    def programs(self) -> int:
        """The largest grid of the part's launches (SMs held while it runs)."""
        grids = [r.launch.programs for rs in self.regions.values() for r in rs]
        grids += [t.programs for t in self.tables.values()]
        return max(grids, default=0)


@dataclass(frozen=True)
class ReferencePart:
    """Rows moved per token through host memory: `positions` `[m]` int64 CPU (in the pair list),
    `device_index` `[m]` int64 on the device (their device slots)."""

    mechanism: ClassVar[Mechanism] = Mechanism.REFERENCE
    rows: int
    positions: torch.Tensor
    device_index: torch.Tensor


Part = CopyPart | StagedPart | KernelPart | ReferencePart


@dataclass(frozen=True)
class RunCopies:
    """An operation that the copy engine moves whole, planned from run lists alone (`Planner.copies`).

    `joint`: a `RunTable`'s `[4, R]` int64 array of its joint runs (host runs cut at segment
    edges); `batched`, `streams`: as `CopyPart`'s; `host_pool`, `device_pool`: the planner's.
    """

    path: TransferPath
    joint: np.ndarray
    host_runs: int
    device_runs: int
    batched: bool
    streams: int
    host_pool: HostPool = field(repr=False, compare=False)
    device_pool: DevicePool = field(repr=False, compare=False)

    def part(self) -> CopyPart:
        """The plan's one part."""
        return copy_part(self.host_pool, RunTable(self.joint), self.batched, self.streams)


class Uploader:
    """Copies CPU index tensors to the plan's device on one stream, then records `ready`."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device, self.stream, self.used = device, stream, False
        if device.type == "cuda" and stream is None:
            self.stream = torch.cuda.current_stream(device)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        self.used = True
        with torch.cuda.stream(self.stream):
            return t.pin_memory().to(self.device, non_blocking=True)

    def finish(self) -> torch.cuda.Event | None:
        if not self.used:
            return None
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return ready


def copy_streams(spec: KVSpec, rows: int, runs: int, batched: bool, costs: PathCosts) -> int:
    """Streams a copy part's copies of one layer (`rows` in `runs`) go over: `costs.copy_streams` for
    batched runs shorter on average than `costs.fan_out_below_bytes`, else one."""
    if batched and runs and rows * spec.widest_row_bytes < costs.fan_out_below_bytes * runs:
        return costs.copy_streams
    return 1


def copy_part(host_pool: HostPool, runs: RunTable, batched: bool, streams: int) -> CopyPart:
    """Copy-engine copies of joint `runs`, with their bytes per buffer (for raw copies)."""
    return CopyPart(
        rows=int(runs.length.sum()),
        runs=runs,
        run_bytes=run_bytes(host_pool, runs.host, runs.device, runs.length),
        batched=batched,
        streams=streams,
    )


def run_bytes(
    host_pool: HostPool, host_at: np.ndarray, dev_at: np.ndarray, lens: np.ndarray
) -> dict[str, RunBytes]:
    """Runs in bytes per buffer name: `host_at`, `dev_at`, `lens` `[runs]` int64, each run's first host
    slot, first device row (a slot, or a staging row) and length."""
    out = {}
    for b in host_pool.spec.buffers:
        region, row = host_pool.locate(b.name, host_at)
        out[b.name] = RunBytes(region, row * b.row_bytes, dev_at * b.row_bytes, lens * b.row_bytes)
    return out


def staged_part(
    host_pool: HostPool,
    hn: np.ndarray,
    dn: np.ndarray,
    pos: np.ndarray,
    lens: np.ndarray,
    cap: int,
    batched: bool,
    streams: int,
    up: Uploader,
) -> StagedPart:
    """Host runs (`pos`, `lens`: `[runs]` int64) of the plan's slots `hn`, `dn` (`[n]` int64) through
    the staging buffer of `cap` rows, cut where a window ends; its rows are the runs' in order."""
    total = int(lens.sum())
    at = np.cumsum(lens) - lens  # each run's first row in the part
    cuts = np.union1d(at, np.arange(cap, total, cap))
    run = np.searchsorted(at, cuts, side="right") - 1
    off = cuts - at[run]
    cut_lens = np.diff(np.append(cuts, total))
    host_at = hn[pos[run]] + off
    window = cuts // cap
    stage_row = cuts - window * cap
    first = np.flatnonzero(np.diff(window, prepend=-1))
    ends = np.append(first[1:], len(cuts))
    windows = tuple(
        Window(w * cap, min((w + 1) * cap, total), a, z)
        for w, a, z in zip(window[first].tolist(), first.tolist(), ends.tolist(), strict=True)
    )
    rows = np.repeat(pos - at, lens) + np.arange(total)
    return StagedPart(
        rows=total,
        runs=RunTable.of(pos[run] + off, host_at, stage_row, cut_lens),
        run_bytes=run_bytes(host_pool, host_at, stage_row, cut_lens),
        windows=windows,
        device_index=up(torch.from_numpy(dn[rows])),
        batched=batched,
        streams=streams if batched else 1,
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
) -> KernelPart:
    """Word offsets for the kernel, per buffer and host region, uploaded once, and their launches.

    Joint runs (`starts`, `lens`: `[runs]` int64) are cut into units of the largest divisor of
    every run length within `max_unit_bytes` (whole pages where slots are page-granular).
    """
    widest = host_pool.spec.widest_row_bytes
    unit = _unit(lens, max(1, opts.max_unit_bytes // widest))
    in_run = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    rows = np.repeat(starts, lens) + in_run
    rows = rows[in_run % unit == 0]
    regions = {}
    for b in host_pool.spec.buffers:  # each buffer's units per host region
        device = device_pool.layer(b.name, b.layers[0]).device
        region, host_row = host_pool.locate(b.name, hn[rows])
        dev_slots, out = dn[rows], []
        for r in np.unique(region).tolist():
            mask = region == r
            host_off = host_row[mask] * b.row_bytes
            dev_off = dev_slots[mask] * b.row_bytes
            src, dst = (host_off, dev_off) if direction is Direction.LOAD else (dev_off, host_off)
            align = kernel_args.common_alignment(src, dst)  # bytes
            word = kernel_args.word_size(b.row_bytes * unit, [align])
            align_words = max(1, align // word)
            launch = opts.launch(b.row_bytes * unit, align_words * word, device, direction)
            src, dst = up(torch.from_numpy(src // word)), up(torch.from_numpy(dst // word))
            out.append(KernelRegion(int(r), src, dst, align_words, word, launch))
        regions[b.name] = tuple(out)
    tables = {}
    if host_pool.layout is HostLayout.PAGE_FIRST and unit == host_pool.spec.page_size:
        for b in host_pool.spec.buffers:
            table = _layer_table(device_pool, b.name, regions[b.name], opts, up)
            if table is not None:
                tables[b.name] = table
    return KernelPart(rows=int(lens.sum()), unit=unit, regions=regions, tables=tables)


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


def _unit(lens: np.ndarray, cap: int) -> int:
    """The largest divisor of every run length that is at most `cap` rows."""
    g = int(np.gcd.reduce(lens)) if len(lens) else 1
    for u in range(min(g, cap), 0, -1):
        if g % u == 0:
            return u
    return 1


def reference_part(d: torch.Tensor, up: Uploader) -> ReferencePart:
    """Every pair of the plan per token: `d` `[n]` int64 CPU, the device slots."""
    n = d.numel()
    return ReferencePart(rows=n, positions=torch.arange(n), device_index=up(d))
