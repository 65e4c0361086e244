"""The planner's rule (`kvtier.transfer.rule`) against its documented cost formula, computed here
independently, and the choices it must make at the ends of the range."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.transfer import rule
from kvtier.transfer.options import PathCosts

B = rule.LINK_BYTES_PER_S


def share(costs: PathCosts, piece: float) -> float:
    """The kernel's share of the link on pieces of `piece` bytes: log-linear between the pairs of
    `costs.kernel_share`, flat past the ends (the `PathCosts` docstring), written out by hand."""
    pairs = costs.kernel_share
    if piece <= pairs[0][0]:
        return pairs[0][1]
    if piece >= pairs[-1][0]:
        return pairs[-1][1]
    for (p0, s0), (p1, s1) in itertools.pairwise(pairs):
        if p0 <= piece <= p1:
            t = (math.log2(piece) - math.log2(p0)) / (math.log2(p1) - math.log2(p0))
            return s0 + (s1 - s0) * t
    raise AssertionError("unreachable")


def time_of(costs: PathCosts, lens: list[int], row_bytes: int, unit: int, j: int) -> float:
    """The module docstring's time(j): the j longest runs copied, the rest by the kernel."""
    ordered = sorted(lens, reverse=True)
    copied = max(sum(costs.copy_fixed_s + n * row_bytes / B for n in ordered[:j]), j * costs.copy_host_s)
    if j:
        copied += costs.copy_call_s
    left = ordered[j:]
    if not left:
        return copied
    rate = share(costs, unit * row_bytes)
    kernel = costs.launch_fixed_s + sum(n * row_bytes for n in left) / (B * rate)
    return copied + kernel + (costs.split_s if j else 0.0)


def allowed(costs: PathCosts, lens: list[int], row_bytes: int) -> int:
    """The most runs the copy engine may take: all where one is of `copy_min_bytes` or more (shorter
    ones ride beside it) or the plan is one run, else none."""
    return len(lens) if len(lens) == 1 or max(lens) * row_bytes >= costs.copy_min_bytes else 0


def copied(costs: PathCosts, lens: list[int], row_bytes: int, unit: int = 1) -> int:
    arr = np.array(lens, dtype=np.int64)
    return int(np.argmin(rule.split_times(costs, arr[rule.longest_first(arr)], row_bytes, unit)))


def test_one_long_run_is_copied_and_many_single_rows_go_to_the_kernel() -> None:
    costs = PathCosts()
    assert copied(costs, [1 << 20], 1152) == 1  # 1.2 GB: one copy
    assert copied(costs, [4096] * 3, 656) == 3  # 2.7 MB each: every run a copy
    assert copied(costs, [64], 48) == 0  # one short run: a launch costs less than a copy call
    assert copied(costs, [1] * 5000, 656) == 0  # single rows: one launch beats 5000 copies
    assert copied(costs, [1] * 5000, 1152) == 0
    assert copied(costs, [], 656) == 0


def test_long_runs_are_copied_and_the_short_ones_left_to_the_kernel() -> None:
    """Two runs of 20 MB among 2000 single rows: the copy engine takes exactly the two long ones."""
    costs = PathCosts()
    lens = [1] * 1000 + [40000] + [1] * 1000 + [40000]
    assert copied(costs, lens, 512) == 2
    # Runs of 2 MB save less on the copy engine than the call and the split cost: all to the kernel.
    assert copied(costs, [1] * 1000 + [4000] + [1] * 1000 + [4000], 512) == 0


def test_runs_under_the_copy_minimum_are_copied_only_beside_a_longer_one() -> None:
    """With copies free, runs shorter than `copy_min_bytes` stay with the kernel unless a run of the
    minimum or more is copied too (or the plan is one run)."""
    free = PathCosts(copy_fixed_s=0.0, copy_call_s=0.0, copy_host_s=0.0, copy_min_bytes=1000 * 48)
    assert copied(free, [999] * 5, 48) == 0
    assert copied(free, [1000] * 2 + [999] * 3, 48) == 5
    assert copied(free, [10], 48) == 1


def test_every_run_of_every_buffer_is_copied_where_that_beats_the_buffers_choices_together() -> None:
    """Runs of 60-62 rows: alone, 132-byte rows (8 KB runs, under `copy_min_bytes`) go to the kernel and
    1152-byte rows are copied; together, one call each, the host issuing the small rows' copies while
    the long ones move: everything copied. With the fan-out's call dearer, the buffers' own choices."""
    lens = np.array([60 + 2 * (i % 2) for i in range(500)], dtype=np.int64)
    costs = PathCosts()
    assert rule.choose(costs, lens, {"indexer": 132}, 16 << 10) == {"indexer": 0}
    assert rule.choose(costs, lens, {"kv": 1152}, 16 << 10) == {"kv": 500}
    assert rule.choose(costs, lens, {"kv": 1152, "indexer": 132}, 16 << 10) == {"kv": 500, "indexer": 500}
    dear = PathCosts(copy_call_s=40e-6)  # a second call costs more than the overlap saves
    alone = rule.choose(dear, lens, {"kv": 1152}, 16 << 10) | rule.choose(
        dear, lens, {"indexer": 132}, 16 << 10
    )
    assert (
        rule.choose(dear, lens, {"kv": 1152, "indexer": 132}, 16 << 10)
        == alone
        != {"kv": 500, "indexer": 500}
    )


def test_longest_first_is_stable() -> None:
    lens = np.array([3, 7, 3, 7, 1], dtype=np.int64)
    assert rule.longest_first(lens).tolist() == [1, 3, 0, 2, 4]


runs_lists = st.lists(st.integers(1, 5000), min_size=1, max_size=40)
row_sizes = st.sampled_from([48, 132, 512, 576, 656, 1152, 4096])
fixed = st.floats(0.0, 50e-6, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(
    lens=runs_lists,
    row_bytes=row_sizes,
    copy_fixed=fixed,
    copy_call=fixed,
    launch_fixed=fixed,
    min_bytes=st.sampled_from([0, 4096, 64 << 10, 1 << 20]),
    unit=st.integers(1, 64),
    split=fixed,
)
def test_the_choice_is_the_least_time_of_the_documented_formula(
    lens, row_bytes, copy_fixed, copy_call, launch_fixed, min_bytes, unit, split
):
    """`copied` against a brute force over every allowed j of time(j), computed here in plain Python."""
    costs = PathCosts(
        copy_fixed_s=copy_fixed,
        copy_call_s=copy_call,
        launch_fixed_s=launch_fixed,
        copy_min_bytes=min_bytes,
        split_s=split,
    )
    j = copied(costs, lens, row_bytes, unit)
    most = allowed(costs, lens, row_bytes)
    assert 0 <= j <= most
    times = [time_of(costs, lens, row_bytes, unit, i) for i in range(most + 1)]
    best = min(times)
    assert times[j] <= best + 1e-9 * max(best, 1e-12), (j, times)


@settings(max_examples=200, deadline=None)
@given(lens=runs_lists, row_bytes=row_sizes, fixes=st.lists(fixed, min_size=2, max_size=6))
def test_a_dearer_copy_never_takes_more_runs(lens, row_bytes, fixes):
    """Raising `copy_fixed_s` (all else equal) never raises the number of runs copied."""
    taken = [copied(PathCosts(copy_fixed_s=c), lens, row_bytes) for c in sorted(fixes)]
    assert taken == sorted(taken, reverse=True), (sorted(fixes), taken)


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(1, 4096), min_size=0, max_size=30),
    row_bytes=st.integers(1, 5000),
    max_unit=st.integers(1, 1 << 16),
)
def test_a_unit_divides_every_run_and_fits_its_bytes(lens, row_bytes, max_unit):
    """`unit_rows`: the largest row count dividing every length within `max_unit_bytes` (one row at least)."""
    arr = np.array(lens, dtype=np.int64)
    u = rule.unit_rows(arr, row_bytes, max_unit)
    assert u >= 1 and all(n % u == 0 for n in lens)
    assert u == 1 or u * row_bytes <= max_unit
    cap = max(1, max_unit // row_bytes)
    g = math.gcd(*lens) if lens else 1
    assert u == max(v for v in range(1, min(g, cap) + 1) if g % v == 0)


def test_units_of_whole_pages() -> None:
    assert rule.unit_rows(np.array([16, 32, 64]), 132, 16 << 10) == 16
    assert rule.unit_rows(np.array([16, 32, 64]), 1152, 16 << 10) == 8  # 16 rows: 18 KB, over 16 KiB
    assert rule.unit_rows(np.array([16, 33]), 48, 16 << 10) == 1


@pytest.mark.parametrize(
    ("runs", "nbytes", "copies"),
    [
        (4, 4 << 20, True),  # few long runs: 4 copies beat 4 MB token by token
        (1, 64 << 10, True),
        (10000, 10000 * 656, False),  # single rows: a Python copy each costs more than the reference path
        (2048, 2048 * 48, False),
    ],
)
def test_without_the_kernel_copies_where_they_beat_the_reference_path(runs, nbytes, copies) -> None:
    costs = PathCosts()
    assert rule.without_kernel(costs, runs, nbytes) is copies
    want = runs * costs.python_copy_s + nbytes / B <= nbytes / (costs.reference_gbps * 1e9)
    assert want is copies


def test_the_kernel_rate_is_log_linear_between_pairs_and_flat_past_them() -> None:
    costs = PathCosts()
    for piece in (1, 64, 128, 200, 256, 300, 1000, 4096, 5000, 1 << 20):
        assert float(costs.kernel_rate(piece)) == pytest.approx(share(costs, piece))
