"""What each mechanism costs the planner: measured rates (`CostModel`) or the fixed thresholds of
`PathCosts` (the fallback), turned into the sizes at which one mechanism beats another.

A `CostModel` holds, per direction, what `kvtier.transfer.calibrate` measured on this GPU:

- `copy[piece bytes]`: the copy engine's GB/s on batched copies of pieces of that size, fanned out
  as the planner fans them out (between sizes, log-linear);
- `device_pass[row bytes]`: the on-device pass of staging (`index_copy_` / `index_select`) on
  rows of that size, GB/s;
- `kernel_rows[row bytes]`: the row kernel on scattered single rows of that size, GB/s;
- `kernel_units[row bytes]`: the row kernel on scattered units of `unit_rows(row bytes)` rows,
  contiguous on both sides (host runs moved into staging, joint runs), GB/s;
- `strided[line bytes]`: 2-D copy-engine copies of lines of that size (`page_first`), GB/s;
- `staged[row bytes][piece bytes]`: staging as a plan does it, timed whole: the copies of host
  pieces of that size and the device pass of rows of that size, GB/s (between pieces,
  log-linear).

From these `Choice.of` gives, for one buffer's rows and direction, the joint-run bytes from
which the copy engine beats the kernel, and the host-run bytes from which a host run whose
device slots are scattered goes through staging by the copy engine; shorter host runs go
through staging by the kernel's units where that (units, then the device pass) beats the
kernel on single rows by more than `COPY_MARGIN`. For joint runs the copy engine wins a tie
within `COPY_MARGIN`: every SM the kernel holds is taken from the model beside it
(bench/FINDINGS.md, "Overlap and interference"); staging, whose device pass holds SMs too,
must be as fast.
Without a model, or one that lacks a row size, `Choice.fallback` gives the fixed thresholds of
`PathCosts`, per buffer.

The planner gives a model's choices a floor, `PathCosts.copy_min_bytes` (64 KiB): the copy engine
takes no joint run, nor stages any host run, shorter than that. The host pays ~0.5-1 us to issue
each copy whatever its size, so under ~64 KiB a copy is issued slower than the link moves it, and
its rate moves by lease, shape and timing (36-55 GB/s for pieces of 32-42 KiB) where the kernel's
holds at ~50 (`bench/probes/probe_copy_issue.py`); a calibration that measured 54 GB/s at
41984-byte pieces planned `deepseek-v3-fp8-packed` backups of runs of 64 rows onto the copy
engine, which ran them at 0.77 of the ceiling against the kernel's 0.94 (bench/FINDINGS.md, "The
measured cost model"). Shorter pieces of small rows may still ride with a wider buffer's
(`kvtier.transfer.splits`), where the layer's copies average the floor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from kvtier.pool.device import Direction
from kvtier.transfer.launch import LINE_BYTES
from kvtier.transfer.options import PathCosts
from kvtier.transfer.runs import Scan, host_groups

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
    # The copy engine on pieces at 16-byte (not 128-byte) aligned addresses, as rows of other sizes.
    copy_unaligned: dict[int, float] = field(default_factory=dict)
    device_pass: dict[int, float] = field(default_factory=dict)
    kernel_rows: dict[int, float] = field(default_factory=dict)
    kernel_units: dict[int, float] = field(default_factory=dict)
    strided: dict[int, float] = field(default_factory=dict)
    staged: dict[int, dict[int, float]] = field(default_factory=dict)

    def knows(self, row_bytes: int) -> bool:
        """Whether every rate `Choice.of` needs for rows of `row_bytes` was measured."""
        tables = (self.device_pass, self.kernel_rows, self.kernel_units, self.staged)
        return bool(self.copy) and all(row_bytes in t for t in tables) and bool(self.staged[row_bytes])

    def copy_gbps(self, piece: float, aligned: bool = True) -> float:
        """The copy engine's GB/s for pieces of `piece` bytes (at line-aligned addresses, or not):
        log-linear between measured sizes, the nearest measurement outside them."""
        return float(self._copy_rates(np.array([piece], dtype=np.float64), aligned)[0])

    def copy_from(self, gbps: float, aligned: bool = True) -> float:
        """The fewest bytes a piece needs for the copy engine to reach `gbps` (NEVER if it does not)."""
        return _first_piece(self._copy_table(aligned), gbps)

    def staged_gbps(self, row_bytes: int, run: float) -> float:
        """Staging by the copy engine's GB/s for host runs of `run` bytes of `row_bytes` rows."""
        return float(_curve(self.staged[row_bytes], np.array([run], dtype=np.float64))[0])

    def staged_from(self, row_bytes: int, gbps: float) -> float:
        """The fewest bytes a host run of `row_bytes` rows needs for staging by the copy engine to reach
        `gbps` (NEVER if it does not)."""
        return _first_piece(self.staged[row_bytes], gbps)

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
    def of(
        cls, rates: Rates | None, row_bytes: int, source: str, least: float = 0.0, staged_least: float = 0.0
    ) -> Choice | None:
        """The choice `rates` imply for rows of `row_bytes` (None where they do not know the size), the
        copy engine taking no run under `least` bytes (the planner's floor, in the module docstring)
        and, where the kernel's units do not beat its single rows, staging no host run under
        `staged_least` (`PathCosts.staged_floor`): there the floor would send the host runs under it
        through the units instead, which ran `deepseek-v3-fp8-packed`'s backups after first-fit churn
        at 0.75-0.81 of the ceiling against 0.89-0.93 (bench/FINDINGS.md, "The measured cost model")."""
        if rates is None or not rates.knows(row_bytes):
            return None
        rows, units = rates.kernel_rows[row_bytes], rates.kernel_units[row_bytes]
        copy_from = functools.partial(rates.copy_from, aligned=row_bytes % LINE_BYTES == 0)
        # Joint runs: the copy engine once its rate is within the margin of the kernel's on units.
        copy_min = copy_from(units / (1 + COPY_MARGIN))
        # Host runs over scattered device slots, without the copy engine: the kernel on single rows,
        # or its units into staging and the device pass, whichever is faster ...
        by_units = 1 / (1 / units + 1 / rates.device_pass[row_bytes])
        units_win = by_units > rows * (1 + COPY_MARGIN)  # a pass more, for a clear gain only
        best = by_units if units_win else rows
        # ... until staging by the copy engine, timed whole, reaches it. No margin: the device pass of
        # staging holds SMs too, and a plan's staged backups ran ~2% under the calibration's rate
        # (bench/FINDINGS.md, "The measured cost model").
        staged_min = max(rates.staged_from(row_bytes, best), least)
        if not units_win:  # under the floor, the kernel; where units win it would send runs there
            staged_min = max(staged_min, staged_least)
        return cls(max(copy_min, least), staged_min, staged_min if units_win else 0.0, source)

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
        heads, rows, per_run = host_groups(found, s, n)  # the short joint runs' host runs
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

    def choice(
        self, row_bytes: int, direction: Direction, least: float = 0.0, staged_least: float = 0.0
    ) -> Choice | None:
        """`Choice.of` this model's rates in `direction` (`least`: its copy floor, `staged_least`: its
        staging floor, bytes)."""
        return Choice.of(self.rates.get(direction), row_bytes, self.source, least, staged_least)

    def planned(self, costs: PathCosts, row_bytes: int, direction: Direction, widest: int) -> Choice | None:
        """`choice` as the planner asks it: floored at `costs.copy_min_bytes` and `costs.staged_floor`
        (for rows of `row_bytes` in a spec whose widest row is `widest`)."""
        staged_least = costs.staged_floor(direction, row_bytes, widest)
        return self.choice(row_bytes, direction, costs.copy_min_bytes, staged_least)

    def to_json(self) -> dict:
        def sizes(table: dict[int, float]) -> dict[str, float]:
            return {str(k): v for k, v in table.items()}

        return {
            "source": self.source,
            "rates": {
                d.value: {
                    **{k: sizes(getattr(r, k)) for k in _TABLES},
                    "staged": {str(rb): sizes(t) for rb, t in r.staged.items()},
                }
                for d, r in self.rates.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """The model `to_json` wrote; `KeyError`, `TypeError` or `ValueError` for anything else."""

        def sizes(table: dict) -> dict[int, float]:
            return {int(s): float(v) for s, v in table.items()}

        rates = {}
        for d, r in data["rates"].items():
            tables = {k: sizes(r[k]) for k in _TABLES}
            staged = {int(rb): sizes(t) for rb, t in r["staged"].items()}
            every = [*tables.values(), *staged.values()]
            if not tables["copy"] or any(v <= 0 for t in every for v in t.values()):
                raise ValueError(f"a missing or non-positive rate in {r}")
            rates[Direction(d)] = Rates(**tables, staged=staged)
        return cls(str(data["source"]), rates)


# `Rates`' tables keyed by one size (bytes), as `to_json` writes them.
_TABLES = ("copy", "copy_unaligned", "device_pass", "kernel_rows", "kernel_units", "strided")
