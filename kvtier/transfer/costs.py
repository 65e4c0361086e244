"""What each mechanism costs the planner: measured rates (`CostModel`) or the fixed thresholds of
`PathCosts` (the fallback), turned into the sizes at which one mechanism beats another.

A `CostModel` holds, per direction, what `kvtier.transfer.calibrate` measured on this GPU:

- `copy[piece bytes]`: the copy engine's GB/s on batched copies of pieces of that size, fanned out
  as the planner fans them out (between sizes, log-linear);
- `device_gbps`: the on-device pass of staging (`index_copy_` / `index_select`);
- `kernel_rows[row bytes]`: the row kernel on scattered single rows of that size, GB/s;
- `kernel_units[row bytes]`: the row kernel on scattered units of `unit_rows(row bytes)` rows,
  contiguous on both sides (host runs moved into staging, joint runs), GB/s;
- `strided[line bytes]`: 2-D copy-engine copies of lines of that size (`page_first`), GB/s;
- `staged[piece bytes]`: staging as a plan does it, timed whole: the copies of host pieces of
  that size and the device pass of 1152-byte rows, GB/s (between sizes, log-linear). Where it
  is measured, it decides which host runs go through staging by the copy engine; older models
  add the copies' time and the device pass's, which was optimistic for backups by ~5%.

From these `Choice.of` gives, for one buffer's rows and direction, the joint-run bytes from
which the copy engine beats the kernel, and the host-run bytes from which a host run whose
device slots are scattered goes through staging, by the copy engine or by the kernel's units.
The copy engine wins a tie within `COPY_MARGIN`: every SM the kernel holds is taken from the
model beside it (bench/FINDINGS.md, "Overlap and interference"). Without a model, or one that
lacks a row size, `Choice.fallback` gives the fixed thresholds of `PathCosts`, per buffer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from kvtier.pool.device import Direction
from kvtier.transfer.launch import LINE_BYTES
from kvtier.transfer.options import PathCosts
from kvtier.transfer.runs import Scan

# The copy engine is preferred while within this share of the kernel's time.
COPY_MARGIN = 0.02
# Kernel units of staged host runs are cut at this many bytes (`unit_rows`), as `KernelOptions`.
UNIT_BYTES = 16 << 10
NEVER = math.inf
# Rows narrower than this cost two read requests for little more than one line's bytes: their host
# runs over scattered device slots go through staging by the kernel's units (bench/FINDINGS.md).
SMALL_ROW_BYTES = 256


def unit_rows(row_bytes: int, unit_bytes: int = UNIT_BYTES) -> int:
    """Rows of one kernel unit for rows of `row_bytes`, at most `unit_bytes` (at least one row)."""
    return max(1, unit_bytes // row_bytes)


@dataclass(frozen=True)
class Rates:
    """One direction's measured rates (see the module docstring); GB/s are 1e9 bytes per second."""

    copy: dict[int, float]
    device_gbps: float
    # The copy engine on pieces at 16-byte (not 128-byte) aligned addresses, as rows of other sizes.
    copy_unaligned: dict[int, float] = field(default_factory=dict)
    kernel_rows: dict[int, float] = field(default_factory=dict)
    kernel_units: dict[int, float] = field(default_factory=dict)
    strided: dict[int, float] = field(default_factory=dict)
    staged: dict[int, float] = field(default_factory=dict)

    def knows(self, row_bytes: int) -> bool:
        return bool(self.copy) and row_bytes in self.kernel_rows and row_bytes in self.kernel_units

    def copy_gbps(self, piece: float, aligned: bool = True) -> float:
        """The copy engine's GB/s for pieces of `piece` bytes (at line-aligned addresses, or not):
        log-linear between measured sizes, the nearest measurement outside them."""
        return float(self._copy_rates(np.array([piece], dtype=np.float64), aligned)[0])

    def copy_from(self, gbps: float, aligned: bool = True) -> float:
        """The fewest bytes a piece needs for the copy engine to reach `gbps` (NEVER if it does not)."""
        return _first_piece(self._copy_table(aligned), gbps)

    def staged_from(self, gbps: float) -> float:
        """The fewest bytes a host run needs for staging by the copy engine to reach `gbps` (NEVER if it
        does not, or `staged` is not measured)."""
        return _first_piece(self.staged, gbps) if self.staged else NEVER

    def _copy_rates(self, pieces: np.ndarray, aligned: bool) -> np.ndarray:
        """`copy_gbps` of each of `pieces` (`[k]` float64 bytes)."""
        return _curve(self._copy_table(aligned), pieces)

    def _copy_table(self, aligned: bool) -> dict[int, float]:
        return self.copy if aligned or not self.copy_unaligned else self.copy_unaligned


def _curve(table: dict[int, float], pieces: np.ndarray) -> np.ndarray:
    """GB/s of `table` (piece bytes -> GB/s) at each of `pieces` (`[k]` float64 bytes): log-linear between
    measured sizes, the nearest measurement outside them."""
    sizes = sorted(table)
    logs = np.log(np.array(sizes, dtype=np.float64))
    return np.interp(np.log(np.maximum(pieces, 1.0)), logs, [table[x] for x in sizes])


def _first_piece(table: dict[int, float], gbps: float) -> float:
    """The fewest bytes a piece needs for `table`'s curve to reach `gbps` (NEVER if it does not)."""
    grid = np.geomspace(min(table), max(table), 256)
    ok = np.flatnonzero(_curve(table, grid) >= gbps)
    return float(grid[ok[0]]) if len(ok) else NEVER


@dataclass(frozen=True)
class Choice:
    """For one buffer and direction, by bytes of its rows: joint runs of `copy_min_bytes` or more go
    to the copy engine; of the rest, a host run (its device slots scattered) of `staged_min_bytes` or
    more goes through staging by the copy engine, one shorter than `kernel_staged_below` (and longer
    than a row) through staging by the kernel, in units; every other row to the kernel alone.
    `source` names the cost model that chose this."""

    copy_min_bytes: float
    staged_min_bytes: float
    kernel_staged_below: float
    source: str

    @classmethod
    def of(cls, rates: Rates | None, row_bytes: int, source: str) -> Choice | None:
        """The choice `rates` imply for rows of `row_bytes` (None where they do not know the size)."""
        if rates is None or not rates.knows(row_bytes):
            return None
        rows, units = rates.kernel_rows[row_bytes], rates.kernel_units[row_bytes]
        copy_from = functools.partial(rates.copy_from, aligned=row_bytes % LINE_BYTES == 0)
        # Joint runs: the copy engine once its rate is within the margin of the kernel's on units.
        copy_min = copy_from(units / (1 + COPY_MARGIN))
        # Host runs over scattered device slots: staging by the copy engine once the copy and the
        # device pass together beat the kernel's single rows ...
        staged_min = NEVER
        if rates.staged:  # measured whole
            staged_min = rates.staged_from(rows)
        elif rows < rates.device_gbps:
            staged_min = copy_from(1 / (1 / rows - 1 / rates.device_gbps))
        # ... and by the kernel's units where they beat single rows, while the copy engine is slower.
        below = 0.0
        if 1 / units + 1 / rates.device_gbps < 1 / rows:
            below = copy_from(units)
        return cls(copy_min, staged_min, below, source)

    @classmethod
    def fallback(cls, costs: PathCosts, direction: Direction, row_bytes: int, widest: int) -> Choice:
        """The fixed thresholds of `costs` for a buffer of `row_bytes` in a spec whose widest row is
        `widest`: its own joint runs of `copy_min_bytes` to the copy engine; host runs staged by the
        copy engine from `staged_min_bytes` (loads) or `backup_staged_min_bytes` (backups) of the
        widest rows, so every buffer of a token goes together; rows under `SMALL_ROW_BYTES` only
        from `copy_min_bytes` of their own, and through staging by the kernel below that."""
        least = costs.staged_min_bytes if direction is Direction.LOAD else costs.backup_staged_min_bytes
        staged = least * row_bytes / widest
        if row_bytes < SMALL_ROW_BYTES:
            staged = max(staged, costs.copy_min_bytes)
            return cls(costs.copy_min_bytes, staged, staged, "defaults")
        return cls(costs.copy_min_bytes, staged, 0.0, "defaults")

    def split(self, found: Scan, rb: int) -> dict[str, tuple[np.ndarray, np.ndarray] | None]:
        """The runs of `found` by mechanism, for a buffer of `rb`-byte rows (the planner's keywords
        `copy`, `staged`, `kernel_staged`, `kernel`: `(starts, lengths)`, `[k]` int64, or None): joint
        runs of `copy_min_bytes` to the copy engine; of the rest, host runs (made of short joint runs)
        to staging by the copy engine or the kernel as this choice says, every other joint run to the
        kernel."""
        js, jl = found.joint
        long = jl * rb >= self.copy_min_bytes
        s, n = js[~long], jl[~long]
        # A short joint run continues the previous one on the host side: same host run.
        cont = np.zeros(len(s), dtype=bool)
        if len(s) > 1:
            cont[1:] = (s[1:] == s[:-1] + n[:-1]) & ~found.host_break[s[1:] // found.step]
        heads = np.flatnonzero(~cont)
        rows = np.add.reduceat(n, heads) if len(heads) else n
        per_run = np.diff(np.append(heads, len(s)))  # joint runs per host run
        # Staging pays only where a host run's device slots are scattered (more than one joint run).
        by_copy = (rows * rb >= self.staged_min_bytes) & (per_run > 1)
        by_kernel = ~by_copy & (rows * rb < self.kernel_staged_below) & (per_run > 1)
        staged = np.repeat(by_copy | by_kernel, per_run)

        def runs(
            mask: np.ndarray, starts: np.ndarray, lens: np.ndarray
        ) -> tuple[np.ndarray, np.ndarray] | None:
            return (starts[mask], lens[mask]) if mask.any() else None

        return {
            "copy": runs(long, js, jl),
            "staged": runs(by_copy, s[heads], rows) if len(heads) else None,
            "kernel_staged": runs(by_kernel, s[heads], rows) if len(heads) else None,
            "kernel": runs(~staged, s, n),
        }


@dataclass(frozen=True)
class CostModel:
    """Measured rates per direction (`Rates`), and where they come from (`source`: the GPU, driver
    and kvtier version of the calibration)."""

    source: str
    rates: dict[Direction, Rates]

    def choice(self, row_bytes: int, direction: Direction) -> Choice | None:
        return Choice.of(self.rates.get(direction), row_bytes, self.source)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "rates": {
                d.value: {
                    "copy": {str(k): v for k, v in r.copy.items()},
                    "copy_unaligned": {str(k): v for k, v in r.copy_unaligned.items()},
                    "device_gbps": r.device_gbps,
                    "kernel_rows": {str(k): v for k, v in r.kernel_rows.items()},
                    "kernel_units": {str(k): v for k, v in r.kernel_units.items()},
                    "strided": {str(k): v for k, v in r.strided.items()},
                    "staged": {str(k): v for k, v in r.staged.items()},
                }
                for d, r in self.rates.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """The model `to_json` wrote; `KeyError`, `TypeError` or `ValueError` for anything else."""
        rates = {}
        for d, r in data["rates"].items():
            keys = ("copy", "copy_unaligned", "kernel_rows", "kernel_units", "strided")
            sizes = {k: {int(s): float(v) for s, v in r[k].items()} for k in keys}
            # A model from before staging was timed whole has no `staged`.
            sizes["staged"] = {int(s): float(v) for s, v in r.get("staged", {}).items()}
            dev = float(r["device_gbps"])
            if dev <= 0 or not sizes["copy"] or any(v <= 0 for s in sizes.values() for v in s.values()):
                raise ValueError(f"a missing or non-positive rate in {r}")
            rates[Direction(d)] = Rates(device_gbps=dev, **sizes)
        return cls(str(data["source"]), rates)
