"""Runs of a plan's slot pairs, found from the slots (`scan`) or from the allocators' run lists
(`joint_runs`); both find the same runs (see the glossary in `kvtier.transfer`), so a plan built
either way is the same plan.
"""

from __future__ import annotations

import functools
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
    first `host` slot, first `device` slot (in a staged part, staging row) and `length`."""

    table: np.ndarray

    @classmethod
    def of(cls, pos: np.ndarray, host: np.ndarray, device: np.ndarray, length: np.ndarray) -> RunTable:
        return cls(np.ascontiguousarray(np.array((pos, host, device, length), dtype=np.int64).reshape(4, -1)))

    def __len__(self) -> int:
        return self.table.shape[1]

    @property
    def host(self) -> np.ndarray:
        return self.table[1]

    @property
    def device(self) -> np.ndarray:
        return self.table[2]

    @property
    def length(self) -> np.ndarray:
        return self.table[3]

    @functools.cached_property
    def triples(self) -> list[tuple[int, int, int]]:
        """`(host, device, length)` of each run as Python ints (made once: loops read it per layer)."""
        return list(zip(*(self.table[i].tolist() for i in (1, 2, 3)), strict=True))


@dataclass(frozen=True)
class Scan:
    """The runs of valid slot pairs, found by `scan`: `host_break`, `dev_break` (`[n // step]` bool,
    where a host or device run starts) and `(starts, lengths)` of the `host` and `joint` runs."""

    step: int
    host_break: np.ndarray
    dev_break: np.ndarray
    host: tuple[np.ndarray, np.ndarray]
    joint: tuple[np.ndarray, np.ndarray]


def scan(host_pool: HostPool, hn: np.ndarray, dn: np.ndarray, step: int) -> Scan:
    """Runs of the pairs `hn`, `dn` (`[n]` int64 host and device slots); `step` > 1 when both are
    whole pages of `step` slots, so only page heads are compared."""
    host_break = breaks(hn, step, host_pool.segment_slots, host_pool.num_slots)
    dev_break = breaks(dn, step)
    return Scan(step, host_break, dev_break, starts(host_break, step), starts(host_break | dev_break, step))


def host_groups(
    found: Scan, starts: np.ndarray, lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Joint runs of `found` (`starts`, `lens`: `[k]` int64, some of its joint runs in order) grouped
    into host runs: a joint run continuing the previous one on the host side is in its host run. Each
    group's first joint run (an index into `starts`), rows and joint runs, `[g]` int64 each."""
    cont = np.zeros(len(starts), dtype=bool)
    if len(starts) > 1:
        cont[1:] = (starts[1:] == starts[:-1] + lens[:-1]) & ~found.host_break[starts[1:] // found.step]
    heads = np.flatnonzero(~cont)
    rows = np.add.reduceat(lens, heads) if len(heads) else lens
    return heads, rows, np.diff(np.append(heads, len(starts)))


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


@dataclass(frozen=True)
class JointRuns:
    """Joint runs found from run lists (`joint_runs`), and how many host and device runs there are."""

    runs: RunTable
    host_runs: int
    device_runs: int


def joint_runs(host: RunList, dev: RunList, segment: int, num_slots: int) -> JointRuns:
    """The joint runs of two run lists (`RunList`), as `scan` finds them, in O(runs) Python."""
    h, d = _merged(host), _merged(dev)
    if segment < num_slots:
        h = [(a + o, take) for a, n in h for o, take in _cut(a, n, segment)]
    if sum(n for _, n in h) != sum(n for _, n in d):
        raise PlanError(f"host runs cover {sum(n for _, n in h)} slots, device runs {sum(n for _, n in d)}")
    out: tuple[list[int], ...] = ([], [], [], [])
    i = j = at = hs = ds = hrem = drem = 0
    while i < len(h) or hrem:
        if hrem == 0:
            hs, hrem = h[i]
            i += 1
        if drem == 0:
            ds, drem = d[j]
            j += 1
        take = min(hrem, drem)
        for lst, v in zip(out, (at, hs, ds, take), strict=True):
            lst.append(v)
        at, hs, ds, hrem, drem = at + take, hs + take, ds + take, hrem - take, drem - take
    table = np.array(out, dtype=np.int64).reshape(4, -1)
    return JointRuns(RunTable(table), host_runs=len(h), device_runs=len(d))


def _merged(runs: RunList) -> RunList:
    out: list[tuple[int, int]] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def _cut(start: int, n: int, segment: int) -> list[tuple[int, int]]:
    """`(offset, length)` cuts of the run `[start, start + n)` that stay within one segment."""
    out, at = [], 0
    while at < n:
        take = min(n - at, segment - (start + at) % segment)
        out.append((at, take))
        at += take
    return out


def layer_spans(local: list[int], most: int) -> list[tuple[int, int]]:
    """`[lo, hi)` spans of consecutive values of `local` (ascending), each at most `most` long."""
    out: list[tuple[int, int]] = []
    for j in local:
        if out and out[-1][1] == j and j - out[-1][0] < most:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out
