"""The planner's rule (the `kvtier.transfer` docstring): which joint runs of each buffer the copy engine
takes, the rest going to the kernel, every split weighed at once from cumulative sums (O(runs log
runs) numpy, no loop over runs), and every run of every buffer copied weighed against that."""

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
    return next(u for u in range(min(g, cap), 0, -1) if g % u == 0)


def split_times(costs: PathCosts, sorted_lens: np.ndarray, row_bytes: int, unit: int) -> np.ndarray:
    """time(j) for j = 0..k (`[k + 1]` float64 seconds) of runs `sorted_lens` (`[k]` int64, longest
    first) of rows of `row_bytes`, the kernel moving units of `unit` rows (module docstring); inf
    where j is not allowed: runs under `copy_min_bytes` are copied only beside a longer one."""
    k, nbytes = len(sorted_lens), sorted_lens * row_bytes
    before = np.concatenate(([0.0], np.cumsum(nbytes / LINK_BYTES_PER_S)))  # seconds of the j longest
    j = np.arange(k + 1)
    copy = np.maximum(j * costs.copy_fixed_s + before, j * costs.copy_host_s) + costs.copy_call_s
    kernel = (before[-1] - before) / float(costs.kernel_rate(unit * row_bytes)) + costs.launch_fixed_s
    copy[0], kernel[k] = 0.0, 0.0  # nothing for the copy engine; nothing left for the kernel
    total = copy + kernel
    total[1:k] += costs.split_s  # a kernel part after copies of the same buffer
    if k > 1 and nbytes[0] < costs.copy_min_bytes:
        total[1:] = np.inf
    return total


def choose(
    costs: PathCosts, lens: np.ndarray, row_bytes: dict[str, int], max_unit_bytes: int
) -> dict[str, int]:
    """Per buffer (`row_bytes`: name -> bytes of its rows), how many of the joint runs (`lens`, `[k]`
    int64) the copy engine takes: each buffer's least time(j), or every run of every buffer where one
    call per buffer, the host issuing every copy while the link moves every byte, takes less."""
    ordered = lens[longest_first(lens)]
    k, n = len(lens), len(row_bytes)
    out, chosen_s, may_copy = {}, 0.0, False
    for name, r in row_bytes.items():
        times = split_times(costs, ordered, r, unit_rows(lens, r, max_unit_bytes))
        out[name] = int(np.argmin(times))
        chosen_s += float(times[out[name]])
        may_copy |= bool(np.isfinite(times[k]))  # some buffer's runs may all be copied
    if n > 1 and k > 1 and may_copy:
        link_s = int(lens.sum()) * sum(row_bytes.values()) / LINK_BYTES_PER_S
        all_s = n * costs.copy_call_s + max(n * k * costs.copy_fixed_s + link_s, n * k * costs.copy_host_s)
        if all_s < chosen_s:
            return dict.fromkeys(row_bytes, k)
    return out


def without_kernel(costs: PathCosts, joint_runs: int, nbytes: int) -> bool:
    """Where the kernel cannot run: whether per-run copies beat the per-token reference path for
    `joint_runs` runs of `nbytes` in all."""
    copies = joint_runs * costs.python_copy_s + nbytes / LINK_BYTES_PER_S
    return copies <= nbytes / (costs.reference_gbps * 1e9)
