"""Building staged parts (`StagedPart`): host runs through the device pool's staging buffer, cut
into windows (`parts.cut_windows`), each buffer in its place (`staging_layout`), in an order
(`pass_order`).

A part of several buffers gives each its own place in the staging buffer where windows of half of
it or more still fit, so one buffer's device pass can run while another's rows are copied (the
executor: `staged`); a backup's only over few host runs (`APART_BACKUP_RUNS`).

A part the kernel's units fill may move to a place after every copy-engine staged part's, where it
fits (`units_apart`), so that it may run on the second stream beside their copies (`phases.placed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.spec import BufferSpec
from kvtier.transfer.options import PathCosts
from kvtier.transfer.parts import (
    Buffers,
    Part,
    RunBytes,
    StagedPart,
    Uploader,
    Window,
    buffers_of,
    by_units,
    cut_windows,
    run_bytes,
)
from kvtier.transfer.runs import RunTable

if TYPE_CHECKING:
    from kvtier.transfer.units import KernelStaging

# A buffer's place in the staging buffer starts on this many bytes.
STAGE_ALIGN = 128
# Whether plans place a staged part's buffers apart (`staging_layout`); off: one after the other.
STAGE_APART = True
# Windows of buffers apart hold a multiple of this many rows (where they hold as many): runs cut
# where a window ends keep units of up to this many rows (`units.unit_of`: the runs' common divisor),
# and pages of up to this many slots stay whole.
WINDOW_ROWS = 64
# A backup's staged buffers lie apart only over fewer host runs than this many per copy stream:
# over more (its two windows' copies each fanned out), apart ran slower on every lease measured
# (`glm-5` after contiguous churn 0.875-0.907 against 0.924-0.942; bench/FINDINGS.md, "Overlapped
# parts"), for a reason not yet found.
APART_BACKUP_RUNS = 2
# Whether a backup's smallest rows may go first (`pass_order`); off: spec order always.
SMALL_FIRST = True


def staging_layout(
    device_pool: DevicePool, buffers: list[BufferSpec], apart: bool = True
) -> tuple[int, dict[str, int]]:
    """Rows of one window of a staged part of `buffers`, and each one's byte offset in the staging
    buffer: with `apart` (and `STAGE_APART`), every buffer its own place (`STAGE_ALIGN`-aligned, in
    spec order) for as many rows as fit them all, rounded down to a multiple of `WINDOW_ROWS` where
    that many fit, where that is at least half of `staging_tokens`; else `staging_tokens` rows, each
    buffer from the start (one after the other)."""
    cap = device_pool.staging_tokens
    if len(buffers) < 2 or not (apart and STAGE_APART):
        return cap, {b.name: 0 for b in buffers}
    room = device_pool.staging(Direction.LOAD).numel() - STAGE_ALIGN * (len(buffers) - 1)
    rows = room // sum(b.row_bytes for b in buffers)
    if rows >= WINDOW_ROWS:
        rows -= rows % WINDOW_ROWS
    if 2 * rows < cap:
        return cap, {b.name: 0 for b in buffers}
    at, out = 0, {}
    for b in buffers:
        out[b.name] = at
        at = _aligned(at + rows * b.row_bytes)
    return rows, out


def staged_parts(
    host_pool: HostPool,
    device_pool: DevicePool,
    direction: Direction,
    hn: np.ndarray,
    dn: np.ndarray,
    runs: Sequence[tuple[tuple[np.ndarray, np.ndarray] | None, KernelStaging | None]],
    batched: bool,
    overlap: bool,
    costs: PathCosts,
    up: Uploader,
    buffers: Buffers = None,
) -> list[StagedPart]:
    """A staged part (`staged_part`) for each of `runs` given: host runs `(pos, lens)` and how the
    kernel moves them (None: the copy engine). With `overlap`, each lays its buffers apart in the
    staging buffer (`staging_layout`), a backup's only over fewer than `APART_BACKUP_RUNS` host
    runs per copy stream; a backup orders them by `pass_order`."""
    named = buffers_of(host_pool.spec, buffers)
    load, streams = direction is Direction.LOAD, costs.copy_streams
    out = []
    for found, kernel in runs:
        if found is None:
            continue
        apart = overlap and (load or len(found[1]) < APART_BACKUP_RUNS * streams)
        cap, at = staging_layout(device_pool, named, apart)
        args = (host_pool, hn, dn, *found, cap, batched, streams, up, buffers, kernel)
        out.append(staged_part(*args, stage_at=at, small_first=None if load else costs.copy_min_bytes))
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
    buffers: Buffers = None,
    kernel: KernelStaging | None = None,
    stage_at: dict[str, int] | None = None,
    small_first: int | None = None,
) -> StagedPart:
    """Host runs (`pos`, `lens`: `[runs]` int64) of the plan's slots `hn`, `dn` (`[n]` int64) through
    windows of `cap` rows of the staging buffer, each buffer from its `stage_at` byte (None: 0), cut
    where a window ends; its rows are the runs' in order. With `kernel`, the row kernel moves them
    between the host and the staging buffer. `small_first`: a window's buffers in the order
    `pass_order` gives them (None: in spec order)."""
    total = int(lens.sum())
    at = np.cumsum(lens) - lens  # each run's first row in the part
    run, off, cut_lens, stage_row, windows = cut_windows(lens, cap)
    host_at = hn[pos[run]] + off
    rows = np.repeat(pos - at, lens) + np.arange(total)
    moved, unit = None, 1
    if kernel is not None:
        moved, unit = kernel.regions(host_pool, host_at, stage_row, cut_lens, windows, buffers, up)
    in_bytes = run_bytes(host_pool, host_at, stage_row, cut_lens, buffers)
    named = buffers_of(host_pool.spec, buffers)
    return StagedPart(
        rows=total,
        runs=RunTable.of(pos[run] + off, host_at, stage_row, cut_lens),
        run_bytes=in_bytes,
        windows=windows,
        device_index=up(torch.from_numpy(dn[rows])),
        batched=batched,
        streams=streams if batched else 1,
        kernel=moved,
        unit=unit,
        window_rows=cap,
        stage_at={b.name: 0 for b in named} | (stage_at or {}),
        order=pass_order(named, in_bytes, windows, moved is not None, small_first),
    )


def pass_order(
    buffers: list[BufferSpec],
    run_bytes: dict[str, RunBytes],
    windows: tuple[Window, ...],
    by_kernel: bool,
    small_first: int | None,
) -> tuple[str, ...]:
    """The order a staged part's buffers move in within a window: in spec order, or with
    `small_first` (backups), the smallest rows first where the kernel's units move them or their
    copies in the first window average at least `small_first` bytes. A backup's first buffer waits
    for its gather while the others' gathers run beside its copies, so the shortest gather goes
    first (`glm-5` from contiguous host slots 0.989 against 0.971); but a copy costs the host about
    a microsecond to issue, and unheld, the small rows' short copies first kept the copy engine
    waiting on the host (bench/FINDINGS.md, "Overlapped parts")."""
    names = tuple(b.name for b in buffers)
    if small_first is None or not SMALL_FIRST or len(buffers) < 2 or not windows:
        return names
    small = min(buffers, key=lambda b: b.row_bytes)
    first = run_bytes[small.name].nbytes[windows[0].first : windows[0].end]
    if by_kernel or (len(first) and first.mean() >= small_first):
        return tuple(b.name for b in sorted(buffers, key=lambda b: b.row_bytes))
    return names


def footprint(part: StagedPart, row_bytes: Mapping[str, int]) -> tuple[int, int]:
    """The staging bytes `[start, end)` that `part`'s windows use: each buffer's place, for its largest
    window (`row_bytes`: each buffer's row bytes)."""
    rows = _largest_window(part)
    start = min(part.stage_at[n] for n in part.buffers)
    return start, max(part.stage_at[n] + rows * row_bytes[n] for n in part.buffers)


def disjoint(a: StagedPart, b: StagedPart, row_bytes: Mapping[str, int]) -> bool:
    """Whether staged parts `a` and `b` use no staging byte in common (`footprint`)."""
    (a0, a1), (b0, b1) = footprint(a, row_bytes), footprint(b, row_bytes)
    return a1 <= b0 or b1 <= a0


def units_apart(parts: tuple[Part, ...], device_pool: DevicePool, direction: Direction) -> tuple[Part, ...]:
    """`parts` with each staged part that the kernel's units fill moved after every copy-engine staged
    part's `footprint` (`STAGE_ALIGN`-aligned), where it fits in the staging buffer; the rest as they
    are (a part moves as a whole: its windows and offsets count from its places, and its window
    rows become its largest window's)."""
    row_bytes = {b.name: b.row_bytes for b in device_pool.spec.buffers}
    engine = [p for p in parts if isinstance(p, StagedPart) and p.kernel is None]
    units = [p for p in parts if by_units(p)]
    if not (engine and units):
        return parts
    room = device_pool.staging(direction).numel()
    at = _aligned(max(footprint(p, row_bytes)[1] for p in engine))
    moved: dict[int, StagedPart] = {}
    for p in units:
        lo, hi = footprint(p, row_bytes)
        if at + hi - lo > room:
            continue
        places = {n: at + v - lo for n, v in p.stage_at.items()}
        moved[id(p)] = dataclasses.replace(p, stage_at=places, window_rows=_largest_window(p))
        at = _aligned(at + hi - lo)
    return tuple(moved.get(id(p), p) for p in parts)


def _largest_window(part: StagedPart) -> int:
    """Rows of `part`'s largest window (0: none)."""
    return max((w.hi - w.lo for w in part.windows), default=0)


def _aligned(at: int) -> int:
    return -(-at // STAGE_ALIGN) * STAGE_ALIGN
