"""`kvtier bench cache --parts alloc`: the host slot allocator at scale, after heavy churn.

Per policy: `AllocatorChurn.steady` holds a pool of millions of slots at about 90%
occupancy through random allocations and frees, then one `alloc(n)` + `free` pair is
timed for a few sizes, and the runs one long prefix would get are counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.bench.churn import AllocatorChurn
from kvtier.bench.common import OpStat, Progress, op_stat, quiet

log = logging.getLogger(__name__)

ALLOC_TARGET_US = 200.0


@dataclass
class AllocRow:
    policy: str
    pool_slots: int
    page_size: int
    churn_ops: int
    occupancy: float  # share of slots allocated when timing
    free_runs: int
    prefix_runs: int | None  # runs of one `prefix`-slot allocation after the churn (None: no room)
    n: int
    pairs: int
    median_us: float
    p99_us: float
    target_us: float
    met: bool


def run_allocator(
    pool_slots: int = 4 * 1024 * 1024,
    page_size: int = 1,
    churn_ops: int = 60_000,
    pairs: int = 2000,
    sizes: Sequence[int] = (64, 1024, 16384),
    policies: Sequence[AllocPolicy | str] = (AllocPolicy.CONTIGUOUS, AllocPolicy.FIRST_FIT),
    max_alloc: int = 4096,
    fill: float = 0.9,
    seed: int = 0,
    progress: Progress = quiet,
    prefix: int = 131072,
) -> list[AllocRow]:
    """Per policy: churn the allocator at ~`fill` occupancy, then time `alloc(n)` + `free` pairs.

    Also counts the runs that one `prefix`-slot allocation gets after the churn (then freed):
    how many host runs a long prefix backed up then would load from.
    """
    rows = []
    for policy in map(AllocPolicy, policies):
        progress(f"allocator {policy.value}: {churn_ops} churn operations")
        alloc = HostSlotAllocator(pool_slots, page_size, policy)
        churn = AllocatorChurn(alloc, seed)
        churn.steady(churn_ops, -(-max_alloc // page_size), fill)
        occupancy = round(1 - alloc.available() / pool_slots, 4)
        runs, prefix_runs = alloc.free_runs(), _runs_of_one(alloc, prefix)
        for n in sizes:
            n = max(page_size, -(-n // page_size) * page_size)
            if n > alloc.available():
                log.warning(
                    "allocator %s: only %d slots free, skipping n=%d", policy.value, alloc.available(), n
                )
                continue
            s = _time_pairs(alloc, n, pairs)
            rows.append(
                AllocRow(
                    policy=policy.value,
                    pool_slots=pool_slots,
                    page_size=page_size,
                    churn_ops=churn_ops,
                    occupancy=occupancy,
                    free_runs=runs,
                    prefix_runs=prefix_runs,
                    n=n,
                    pairs=pairs,
                    median_us=s.median_us,
                    p99_us=s.p99_us,
                    target_us=ALLOC_TARGET_US,
                    met=s.p99_us <= ALLOC_TARGET_US,
                )
            )
    return rows


def _runs_of_one(alloc: HostSlotAllocator, n: int) -> int | None:
    """The runs one `alloc(n)` would get now (it is freed again); None when `n` slots are not free."""
    got = alloc.alloc_runs(n) if n <= alloc.available() else None
    if got is None:
        return None
    alloc.free(got[0])
    return len(got[1])


def _time_pairs(alloc: HostSlotAllocator, n: int, pairs: int) -> OpStat:
    """The host time of `pairs` calls of `alloc(n)` followed by freeing what it returned."""
    samples = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        slots = alloc.alloc(n)
        alloc.free(slots)
        samples.append(time.perf_counter() - t0)
    return op_stat("alloc+free", samples)


def render(rows: list[AllocRow], meta: dict) -> Table:
    """The allocator's table: per policy and size, the time of one alloc + free pair against its target."""
    a = meta["alloc"]
    table = Table(
        title=f"HostSlotAllocator, {a['slots']} slots, page {meta['page_size']}, "
        f"after {a['churn']} random alloc/free of 1-4096 slots at ~90% full"
    )
    cols = ("policy", "occupancy", "free runs", "runs of 131072", "n", "median us", "p99 us", "target", "met")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        table.add_row(
            r.policy,
            f"{r.occupancy:.3f}",
            str(r.free_runs),
            "no room" if r.prefix_runs is None else str(r.prefix_runs),
            str(r.n),
            f"{r.median_us:.1f}",
            f"{r.p99_us:.1f}",
            f"<= {r.target_us:.0f}",
            "yes" if r.met else "[red]no[/red]",
        )
    return table
