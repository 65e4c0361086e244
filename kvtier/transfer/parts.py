"""The parts of a plan: one type per mechanism, each with only what its executor reads.

- `CopyPart`: joint runs the copy engine moves straight between host and device slots;
- `StagedPart`: host runs through a device staging buffer, placed on their scattered
  device slots on the device (loads), or the reverse (backups), built by `staging`;
- `StackPart`: `page_first` runs of pages, several layers of a page per copy, through the
  staging buffer (`stacks`);
- `KernelPart`: units the Triton kernels gather or scatter, each launch's shape computed
  here, once;
- `ReferencePart`: per-token gather and scatter through host memory.

The builders turn runs (`runs`) into parts; every index a part needs on the device is
uploaded once, by the plan's `Uploader`. Byte offsets on the host count from a region's
first row of a layer (`HostPool.locate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, TypeGuard

import numpy as np
import torch

from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostPool
from kvtier.spec import BufferSpec, KVSpec
from kvtier.transfer.launch import KernelLaunch
from kvtier.transfer.options import Mechanism, PathCosts, TransferPath
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

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.run_bytes)


class Window(NamedTuple):
    """One fill of the staging buffer: part rows `[lo, hi)`, moved by the part's runs `[first, end)`."""

    lo: int
    hi: int
    first: int
    end: int


@dataclass(frozen=True)
class KernelRegion:
    """The kernel's units of one buffer in one host region, and their `launch`: `src`/`dst` `[m]`
    int64 word offsets on the device (swapped for backups), in words of `word` bytes (the widest
    the unit and every offset allow), all multiples of `align` words (a power of two); `wide`: the
    units' host rows take the wide grid (`launch.is_wide`: a wide span, short pieces)."""

    region: int
    src: torch.Tensor
    dst: torch.Tensor
    align: int
    word: int
    launch: KernelLaunch
    wide: bool = False


@dataclass(frozen=True)
class StagedPart:
    """Host runs cut where a window ends (`device`: a run's first staging row; in bytes per buffer:
    `run_bytes`), through the staging buffer to `device_index` (`[rows]` int64 on the device).

    Between the host and the staging buffer the copy engine moves the runs, or, where `kernel` is
    set, the row kernel: per buffer name, per window, its units of `unit` rows per host region."""

    mechanism: ClassVar[Mechanism] = Mechanism.STAGED
    rows: int
    runs: RunTable
    run_bytes: dict[str, RunBytes]
    windows: tuple[Window, ...]
    device_index: torch.Tensor
    batched: bool
    streams: int
    # Rows of one window, and each buffer's byte offset in the staging buffer (`staging_layout`).
    window_rows: int
    stage_at: dict[str, int]
    # The order a window's buffers move in (`pass_order`).
    order: tuple[str, ...]
    kernel: dict[str, tuple[tuple[KernelRegion, ...], ...]] | None = None
    unit: int = 1

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.run_bytes)

    @property
    def apart(self) -> bool:
        """Whether each buffer of a window has its own place in the staging buffer (several buffers
        only): one buffer's device pass may then run while the next buffer's rows arrive."""
        return len(set(self.stage_at.values())) > 1


@dataclass(frozen=True)
class StackRuns:
    """One buffer's runs of pages in a `StackPart`, cut where a window ends: `[k]` int64 each, the host
    region, the byte offset in it of the run's first page (its first layer's rows), the run's first
    page in its window, and its pages. A window holds the stacks of up to `layers` layers; a call of
    every layer of the buffer copies a window's runs over `streams` streams."""

    layers: int
    region: np.ndarray
    host: np.ndarray
    stage: np.ndarray
    pages: np.ndarray
    windows: tuple[Window, ...]
    streams: int


@dataclass(frozen=True)
class StackPart:
    """`page_first` runs of whole pages moved as stacks (a page's rows of consecutive layers, adjacent on
    the host) between the host and the staging buffer by the copy engine, and between the staging
    buffer and each layer on the device (`kvtier.transfer.stacks`): per buffer name its `StackRuns`;
    `device_pages` `[pages]` int64 on the device, the device page of each of the part's pages."""

    mechanism: ClassVar[Mechanism] = Mechanism.STACKED
    rows: int
    runs: dict[str, StackRuns]
    device_pages: torch.Tensor

    @property
    def buffers(self) -> frozenset[str]:
        return frozenset(self.runs)


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
    def buffers(self) -> frozenset[str]:
        return frozenset(self.regions)

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
    buffers: frozenset[str] = frozenset()


Part = CopyPart | StagedPart | StackPart | KernelPart | ReferencePart


def by_units(part: Part) -> TypeGuard[StagedPart]:
    """Whether `part` is staging that the kernel's units fill (or drain)."""
    return isinstance(part, StagedPart) and part.kernel is not None


# The buffer names a part moves; None: every buffer of the spec.
Buffers = frozenset[str] | None


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


def widest(spec: KVSpec, buffers: Buffers) -> int:
    """The widest row, in bytes, of the named buffers of `spec` (None: all of them)."""
    return max(b.row_bytes for b in buffers_of(spec, buffers))


def buffers_of(spec: KVSpec, names: Buffers) -> list[BufferSpec]:
    """The named buffers of `spec`, in its order (None: all)."""
    return [b for b in spec.buffers if names is None or b.name in names]


def copy_streams(
    spec: KVSpec, rows: int, runs: int, batched: bool, costs: PathCosts, buffers: Buffers = None
) -> int:
    """Streams a copy part's copies of one layer (`rows` in `runs`) go over: `costs.copy_streams` for
    batched runs shorter on average than `costs.fan_out_below_bytes`, else one."""
    if batched and runs and rows * widest(spec, buffers) < costs.fan_out_below_bytes * runs:
        return costs.copy_streams
    return 1


def copy_part(
    host_pool: HostPool, runs: RunTable, batched: bool, streams: int, buffers: Buffers = None
) -> CopyPart:
    """Copy-engine copies of joint `runs` of the named buffers, with their bytes per buffer."""
    return CopyPart(
        rows=int(runs.length.sum()),
        runs=runs,
        run_bytes=run_bytes(host_pool, runs.host, runs.device, runs.length, buffers),
        batched=batched,
        streams=streams,
    )


def run_bytes(
    host_pool: HostPool, host_at: np.ndarray, dev_at: np.ndarray, lens: np.ndarray, buffers: Buffers = None
) -> dict[str, RunBytes]:
    """Runs in bytes per buffer name: `host_at`, `dev_at`, `lens` `[runs]` int64, each run's first host
    slot, first device row (a slot, or a staging row) and length."""
    out = {}
    for b in buffers_of(host_pool.spec, buffers):
        region, row = host_pool.locate(b.name, host_at)
        out[b.name] = RunBytes(region, row * b.row_bytes, dev_at * b.row_bytes, lens * b.row_bytes)
    return out


def cut_windows(
    lens: np.ndarray, cap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[Window, ...]]:
    """Runs of `lens` (`[runs]` int64) laid end to end and cut where a window of `cap` ends: per cut,
    `[cuts]` int64 its run, its offset in the run, its length and its first place in its window;
    and the windows."""
    total = int(lens.sum())
    at = np.cumsum(lens) - lens
    cuts = np.union1d(at, np.arange(cap, total, cap))
    run = np.searchsorted(at, cuts, side="right") - 1
    window = cuts // cap
    first = np.flatnonzero(np.diff(window, prepend=-1))
    ends = np.append(first[1:], len(cuts))
    windows = tuple(
        Window(w * cap, min((w + 1) * cap, total), a, z)
        for w, a, z in zip(window[first].tolist(), first.tolist(), ends.tolist(), strict=True)
    )
    return run, cuts - at[run], np.diff(np.append(cuts, total)), cuts - window * cap, windows


def reference_part(d: torch.Tensor, up: Uploader, buffers: frozenset[str]) -> ReferencePart:
    """Every pair of the plan per token: `d` `[n]` int64 CPU, the device slots."""
    n = d.numel()
    return ReferencePart(rows=n, positions=torch.arange(n), device_index=up(d), buffers=buffers)
