"""Joint runs of a plan's slot pairs, from the slots (`scan`) or from the allocators' run lists
(`joint_runs`): the same runs either way, found in numpy with no loop over runs.

A host run is consecutive positions whose host slots go up by one within a segment
(`HostPool.segment_slots`); a device run, whose device slots go up by one; a joint run, both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvtier.errors import PlanError
from kvtier.pool.host import HostPool

# `(first slot, length)` runs of slots, in plan order (as the allocators hand them out).
RunList = list[tuple[int, int]]
# `(host runs, device runs)` of one operation.
RunPair = tuple[RunList, RunList]


@dataclass(frozen=True)
class RunTable:
    """Runs as one `[4, k]` int64 C-contiguous array, a column per run: its position in the pair list,
    first `host` slot, first `device` slot and `length`."""

    table: np.ndarray

    @classmethod
    def of(cls, pos: np.ndarray, host: np.ndarray, device: np.ndarray, length: np.ndarray) -> RunTable:
        return cls(np.ascontiguousarray(np.array((pos, host, device, length), dtype=np.int64).reshape(4, -1)))

    def __len__(self) -> int:
        return self.table.shape[1]

    @property
    def pos(self) -> np.ndarray:
        return self.table[0]

    @property
    def host(self) -> np.ndarray:
        return self.table[1]

    @property
    def device(self) -> np.ndarray:
        return self.table[2]

    @property
    def length(self) -> np.ndarray:
        return self.table[3]


@dataclass(frozen=True)
class JointRuns:
    """The joint runs of one operation, and how many host and device runs there are."""

    runs: RunTable
    host_runs: int
    device_runs: int


def scan(host_pool: HostPool, hn: np.ndarray, dn: np.ndarray, step: int) -> JointRuns:
    """Runs of the pairs `hn`, `dn` (`[n]` int64 host and device slots); `step` > 1 when both are
    whole pages of `step` slots, so only page heads are compared."""
    host_break = breaks(hn, step, host_pool.segment_slots, host_pool.num_slots)
    dev_break = breaks(dn, step)
    first, lens = starts(host_break | dev_break, step)
    table = RunTable.of(first, hn[first], dn[first], lens)
    return JointRuns(table, int(host_break.sum()), int(dev_break.sum()))


def breaks(slots: np.ndarray, step: int, segment: int | None = None, num_slots: int = 0) -> np.ndarray:
    """Where a run of `slots` (`[n]` int64) starts, per `step` slots: `[n // step]` bool; also at a
    segment edge (`segment` slots, host side) when the pool has more than one segment."""
    heads = slots[::step] if step > 1 else slots
    out = np.ones(len(heads), dtype=bool)
    if len(heads) > 1:
        np.not_equal(np.diff(heads), step, out=out[1:])
        if segment is not None and segment < num_slots:
            out[1:] |= heads[1:] % segment == 0
    return out


def starts(run_breaks: np.ndarray, step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths, in slots, of the runs that `run_breaks` (`[n // step]` bool) delimits."""
    first = np.flatnonzero(run_breaks)
    lens = np.diff(np.append(first, len(run_breaks)))
    return first * step, lens * step


def joint_runs(host: RunList, dev: RunList, segment: int, num_slots: int) -> JointRuns:
    """The joint runs of two run lists (`RunList`), as `scan` finds them."""
    hs, hl = _merged(host)
    if segment < num_slots:
        hs, hl = _cut(hs, hl, segment)
    ds, dl = _merged(dev)
    if hl.sum() != dl.sum():
        raise PlanError(f"host runs cover {int(hl.sum())} slots, device runs {int(dl.sum())}")
    h_at, d_at = _offsets(hl), _offsets(dl)
    pos = np.union1d(h_at, d_at)
    hi = np.searchsorted(h_at, pos, side="right") - 1
    di = np.searchsorted(d_at, pos, side="right") - 1
    lens = np.diff(np.append(pos, hl.sum()))
    table = RunTable.of(pos, hs[hi] + pos - h_at[hi], ds[di] + pos - d_at[di], lens)
    return JointRuns(table, host_runs=len(hs), device_runs=len(ds))


def _merged(runs: RunList) -> tuple[np.ndarray, np.ndarray]:
    """`(first slots, lengths)`, `[k]` int64 each, of `runs` with empty runs dropped and each run that
    continues the one before joined to it."""
    if isinstance(runs, np.ndarray):
        arr = runs.astype(np.int64, copy=False).reshape(-1, 2)
    else:  # from a list of pairs, several times faster than `np.asarray`
        arr = np.fromiter(itertools.chain.from_iterable(runs), np.int64, 2 * len(runs)).reshape(-1, 2)
    arr = arr[arr[:, 1] > 0]
    if not len(arr):
        return arr[:, 0], arr[:, 1]
    head = np.ones(len(arr), dtype=bool)
    head[1:] = arr[1:, 0] != arr[:-1, 0] + arr[:-1, 1]
    first = np.flatnonzero(head)
    return arr[first, 0], np.add.reduceat(arr[:, 1], first)


def _cut(first: np.ndarray, lens: np.ndarray, segment: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs cut where a segment of `segment` slots ends, so none crosses a segment edge."""
    edges = (first + lens - 1) // segment - first // segment  # edges inside each run
    if not edges.any():
        return first, lens
    run = np.repeat(np.arange(len(first)), edges + 1)
    k = np.arange(len(run)) - np.repeat(np.cumsum(edges + 1) - (edges + 1), edges + 1)
    lo = np.where(k == 0, first[run], (first[run] // segment + k) * segment)
    hi = np.minimum(first[run] + lens[run], (first[run] // segment + k + 1) * segment)
    return lo, hi - lo


def _offsets(lens: np.ndarray) -> np.ndarray:
    """Each run's first position in the plan: `[k]` int64."""
    if not len(lens):
        return lens.copy()
    return np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
