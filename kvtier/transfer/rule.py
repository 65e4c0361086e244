"""The planner's rule (written out in the `kvtier.transfer` docstring): which joint runs of one buffer
the copy engine takes, the rest going to the kernel, weighed for every split at once from cumulative
sums (O(runs log runs) numpy, no loop over runs)."""

from __future__ import annotations

import numpy as np

from kvtier.transfer.options import PathCosts

# The link's rate the fixed costs are weighed against, bytes per second (a PCIe Gen5 x16 GPU's
# contiguous pinned copy, bench/FINDINGS.md); only the ratio of fixed costs to bytes depends on it.
LINK_BYTES_PER_S = 53e9


def longest_first(lens: np.ndarray) -> np.ndarray:
    """Indices of `lens` (`[k]` int64 run lengths) longest first, ties in plan order."""
    return np.argsort(-lens, kind="stable")


def unit_rows(lens: np.ndarray, row_bytes: int, max_unit_bytes: int) -> int:
    """Rows of one kernel unit over runs of `lens` (`[k]` int64): the largest divisor of every length
    within `max_unit_bytes` of rows of `row_bytes` (at least one row)."""
    cap = max(1, max_unit_bytes // row_bytes)
    g = int(np.gcd.reduce(lens)) if len(lens) else 1
    for u in range(min(g, cap), 0, -1):
        if g % u == 0:
            return u
    return 1


def copied(costs: PathCosts, sorted_lens: np.ndarray, row_bytes: int, unit: int) -> int:
    """How many of the runs (`sorted_lens`: `[k]` int64, longest first) the copy engine takes for rows
    of `row_bytes`, when the kernel moves units of `unit` rows (module docstring)."""
    k = len(sorted_lens)
    if k == 0:
        return 0
    nbytes = sorted_lens * row_bytes
    most = k if k == 1 else int(np.count_nonzero(nbytes >= costs.copy_min_bytes))
    x = nbytes.astype(np.float64) / LINK_BYTES_PER_S  # seconds at the link's rate
    before = np.concatenate(([0.0], np.cumsum(x)))  # seconds of the j longest runs
    j = np.arange(k + 1)
    copy = np.maximum(j * costs.copy_fixed_s + before, j * costs.copy_host_s) + costs.copy_call_s
    copy[0] = 0.0  # nothing for the copy engine
    rate = float(costs.kernel_rate(unit * row_bytes))
    kernel = (before[-1] - before) / rate + costs.launch_fixed_s
    kernel[-1] = 0.0  # nothing left for the kernel
    return int(np.argmin((copy + kernel)[: most + 1]))


def without_kernel(costs: PathCosts, joint_runs: int, nbytes: int) -> bool:
    """Where the kernel cannot run: whether per-run copies beat the per-token reference path for
    `joint_runs` runs of `nbytes` in all."""
    copies = joint_runs * costs.python_copy_s + nbytes / LINK_BYTES_PER_S
    return copies <= nbytes / (costs.reference_gbps * 1e9)
