"""What each mechanism costs the planner: measured rates (`CostModel`) or the fixed thresholds of
`PathCosts` (the fallback), turned into the sizes at which one mechanism beats another.

A `CostModel` holds, per direction, what `kvtier.transfer.calibrate` measured on this GPU:

- `copy[piece bytes]`: the copy engine's GB/s on batched copies of pieces of that size, fanned out
  as the planner fans them out (between sizes, log-linear);
- `device_gbps`: the on-device pass of staging (`index_copy_` / `index_select`);
- `kernel_rows[row bytes]`: the row kernel on scattered single rows of that size, GB/s;
- `kernel_units[row bytes]`: the row kernel on scattered units of `unit_rows(row bytes)` rows,
  contiguous on both sides (host runs moved into staging, joint runs), GB/s;
- `strided[line bytes]`: 2-D copy-engine copies of lines of that size (`page_first`), GB/s.

From these `Choice.of` gives, for one buffer's rows and direction, the joint-run bytes from
which the copy engine beats the kernel, and the host-run bytes from which a host run whose
device slots are scattered goes through staging, by the copy engine or by the kernel. The
copy engine wins a tie within `COPY_MARGIN`: every SM the kernel holds is taken from the
model beside it (bench/FINDINGS.md, "Overlap and interference"). Without a measurement for a
row size the defaults hold (`PathCosts` thresholds by the widest row, staging for loads
only, never the kernel into staging), which is what the planner did before it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvtier.pool.device import Direction
from kvtier.transfer.options import PathCosts

# The copy engine is preferred while within this share of the kernel's time.
COPY_MARGIN = 0.02
# Kernel units of staged host runs are cut at this many bytes (`unit_rows`), as `KernelOptions`.
UNIT_BYTES = 16 << 10
NEVER = math.inf


def unit_rows(row_bytes: int, unit_bytes: int = UNIT_BYTES) -> int:
    """Rows of one kernel unit for rows of `row_bytes`, at most `unit_bytes` (at least one row)."""
    return max(1, unit_bytes // row_bytes)


@dataclass(frozen=True)
class Rates:
    """One direction's measured rates (see the module docstring); GB/s are 1e9 bytes per second."""

    copy: dict[int, float]
    device_gbps: float
    kernel_rows: dict[int, float] = field(default_factory=dict)
    kernel_units: dict[int, float] = field(default_factory=dict)
    strided: dict[int, float] = field(default_factory=dict)

    def knows(self, row_bytes: int) -> bool:
        return bool(self.copy) and row_bytes in self.kernel_rows and row_bytes in self.kernel_units

    def copy_gbps(self, piece: float) -> float:
        """The copy engine's GB/s for pieces of `piece` bytes: log-linear between measured sizes,
        the nearest measurement outside them."""
        sizes = sorted(self.copy)
        logs = np.log([float(x) for x in sizes])
        return float(np.interp(np.log(max(piece, 1.0)), logs, [self.copy[x] for x in sizes]))

    def copy_from(self, gbps: float) -> float:
        """The fewest bytes a piece needs for the copy engine to reach `gbps` (NEVER if it does not)."""
        grid = np.geomspace(min(self.copy), max(self.copy), 256)
        rates = np.array([self.copy_gbps(x) for x in grid])
        ok = np.flatnonzero(rates >= gbps)
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
        # Joint runs: the copy engine once its rate is within the margin of the kernel's on units.
        copy_min = rates.copy_from(units / (1 + COPY_MARGIN))
        # Host runs over scattered device slots: staging by the copy engine once the copy and the
        # device pass together beat the kernel's single rows ...
        staged_min = NEVER
        if rows < rates.device_gbps:
            staged_min = rates.copy_from(1 / (1 / rows - 1 / rates.device_gbps))
        # ... and by the kernel's units where they beat single rows, while the copy engine is slower.
        below = 0.0
        if 1 / units + 1 / rates.device_gbps < 1 / rows:
            below = rates.copy_from(units)
        return cls(copy_min, staged_min, below, source)

    @classmethod
    def fallback(cls, costs: PathCosts, direction: Direction) -> Choice:
        """The fixed thresholds of `costs` (compared by the widest row): staging for loads only."""
        staged = costs.staged_min_bytes if direction is Direction.LOAD else NEVER
        return cls(costs.copy_min_bytes, staged, 0.0, "defaults")


@dataclass(frozen=True)
class CostModel:
    """Measured rates per direction (`Rates`), and where they come from (`source`: the GPU, driver
    and kvtier version of the calibration)."""

    source: str
    rates: dict[Direction, Rates]

    def choice(self, row_bytes: int, direction: Direction) -> Choice | None:
        return Choice.of(self.rates.get(direction), row_bytes, self.source)

    def strided_beats(self, line_bytes: int, direction: Direction, kernel_gbps: float) -> bool:
        """Whether 2-D copies of `line_bytes` lines beat the kernel at `kernel_gbps` (within the margin)."""
        rates = self.rates.get(direction)
        if rates is None or line_bytes not in rates.strided:
            return False
        return rates.strided[line_bytes] * (1 + COPY_MARGIN) >= kernel_gbps

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "rates": {
                d.value: {
                    "copy": {str(k): v for k, v in r.copy.items()},
                    "device_gbps": r.device_gbps,
                    "kernel_rows": {str(k): v for k, v in r.kernel_rows.items()},
                    "kernel_units": {str(k): v for k, v in r.kernel_units.items()},
                    "strided": {str(k): v for k, v in r.strided.items()},
                }
                for d, r in self.rates.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """The model `to_json` wrote; `KeyError`, `TypeError` or `ValueError` for anything else."""
        rates = {}
        for d, r in data["rates"].items():
            keys = ("copy", "kernel_rows", "kernel_units", "strided")
            sizes = {k: {int(s): float(v) for s, v in r[k].items()} for k in keys}
            dev = float(r["device_gbps"])
            if dev <= 0 or not sizes["copy"] or any(v <= 0 for s in sizes.values() for v in s.values()):
                raise ValueError(f"a missing or non-positive rate in {r}")
            rates[Direction(d)] = Rates(device_gbps=dev, **sizes)
        return cls(str(data["source"]), rates)
