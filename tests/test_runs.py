"""Joint runs (`kvtier.transfer.runs`): found from run lists (`joint_runs`) they equal those found
from the slots (`scan`), over host pools of one or many segments and any page size; no run crosses
a segment edge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import PlanError
from kvtier.pool import HostLayout, HostPool
from kvtier.spec import preset
from kvtier.transfer import runs as slot_runs

HOST_SLOTS = 512
# (layout, page size, chunk bytes): one segment, several segments (layer_first with small chunks),
# and page_first (a segment per page) with one chunk or many.
POOLS = [
    (HostLayout.LAYER_FIRST, 1, 1 << 30),
    (HostLayout.LAYER_FIRST, 1, 4096),
    (HostLayout.LAYER_FIRST, 4, 4096),
    (HostLayout.LAYER_FIRST, 16, 8192),
    (HostLayout.PAGE_FIRST, 1, 1 << 30),
    (HostLayout.PAGE_FIRST, 4, 2048),
]
_pools: dict[tuple, HostPool] = {}


def pool(layout: HostLayout, ps: int, chunk_bytes: int) -> HostPool:
    key = (layout, ps, chunk_bytes)
    if key not in _pools:
        _pools[key] = HostPool(preset("tiny-dsa", ps), HOST_SLOTS, layout, chunk_bytes=chunk_bytes)
    return _pools[key]


def test_the_pools_have_the_segments_the_cases_need() -> None:
    segments = {key: pool(*key).num_segments() for key in POOLS}
    assert segments[POOLS[0]] == 1 and segments[POOLS[1]] > 1 and segments[POOLS[2]] > 1
    assert segments[POOLS[4]] == HOST_SLOTS and segments[POOLS[5]] == HOST_SLOTS // 4


def as_run_list(slots: np.ndarray, cuts: list[bool]) -> list[tuple[int, int]]:
    """`slots` as `(first, length)` runs of consecutive ascending slots, cut further where `cuts[i]`
    (an allocator may hand over a run in pieces)."""
    out: list[tuple[int, int]] = []
    for i, s in enumerate(slots.tolist()):
        if out and out[-1][0] + out[-1][1] == s and not cuts[i % len(cuts)]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


@st.composite
def page_slots(draw, pages_total: int, ps: int, n_pages: int) -> np.ndarray:
    """`n_pages` distinct whole pages of `ps` slots: an ascending stretch of `k` pages (as a contiguous
    allocator hands out) before or after pages in random order."""
    order = draw(st.permutations(range(pages_total)))
    k = draw(st.integers(0, n_pages))
    start = draw(st.integers(0, pages_total - k))
    stretch = list(range(start, start + k))
    rest = [p for p in order if not start <= p < start + k][: n_pages - k]
    pages = np.array(stretch + rest if draw(st.booleans()) else rest + stretch, dtype=np.int64)
    return (pages[:, None] * ps + np.arange(ps)).reshape(-1)


@settings(max_examples=80, deadline=None)
@pytest.mark.parametrize("key", POOLS, ids=[f"{k[0].value}-{k[1]}-{k[2]}" for k in POOLS])
@given(data=st.data())
def test_runs_from_run_lists_equal_runs_from_slots(key, data) -> None:
    host = pool(*key)
    ps = host.spec.page_size
    n_pages = data.draw(st.integers(1, HOST_SLOTS // ps // 2), label="pages")
    hs = data.draw(page_slots(HOST_SLOTS // ps, ps, n_pages), label="host")
    ds = data.draw(page_slots(HOST_SLOTS // ps, ps, n_pages), label="device")
    cuts = data.draw(st.lists(st.booleans(), min_size=1, max_size=7), label="cuts")
    per_slot = slot_runs.scan(host, hs, ds, 1)
    per_page = slot_runs.scan(host, hs, ds, ps)
    lists = slot_runs.joint_runs(
        as_run_list(hs, cuts), as_run_list(ds, cuts[::-1]), host.segment_slots, HOST_SLOTS
    )
    for found in (per_page, lists):
        assert found.runs.table.tolist() == per_slot.runs.table.tolist()
        assert (found.host_runs, found.device_runs) == (per_slot.host_runs, per_slot.device_runs)
    # The runs, independently: each pairs consecutive host and device slots within one segment,
    # they tile the positions in order, and no two neighbours could have been one run.
    t = per_slot.runs
    assert t.pos.tolist() == np.concatenate(([0], np.cumsum(t.length)[:-1])).tolist()
    assert int(t.length.sum()) == len(hs)
    seg = host.segment_slots
    for pos, h, d, n in zip(
        t.pos.tolist(), t.host.tolist(), t.device.tolist(), t.length.tolist(), strict=True
    ):
        assert hs[pos : pos + n].tolist() == list(range(h, h + n))
        assert ds[pos : pos + n].tolist() == list(range(d, d + n))
        assert h // seg == (h + n - 1) // seg
    for a in range(len(t) - 1):
        end = t.host[a] + t.length[a]
        joinable = t.host[a + 1] == end and t.device[a + 1] == t.device[a] + t.length[a] and end % seg != 0
        assert not joinable


@settings(max_examples=300, deadline=None)
@given(
    segment=st.integers(1, 64),
    runs=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 300)), min_size=0, max_size=20),
)
def test_cutting_at_segment_edges_keeps_every_slot_and_crosses_no_edge(segment, runs) -> None:
    first = np.array([r[0] for r in runs], dtype=np.int64)
    lens = np.array([r[1] for r in runs], dtype=np.int64)
    lo, n = slot_runs._cut(first, lens, segment)
    assert (n > 0).all()
    assert (lo // segment == (lo + n - 1) // segment).all()  # within one segment each
    got = [s for a, k in zip(lo.tolist(), n.tolist(), strict=True) for s in range(a, a + k)]
    want = [s for a, k in runs for s in range(a, a + k)]
    assert got == want  # the same slots, in order
    # Cut only at edges: a piece ends at its run's end or at a segment edge.
    ends = (lo + n) % segment == 0
    run_ends = set((first + lens).tolist())
    assert all(e or int(a + k) in run_ends for a, k, e in zip(lo, n, ends, strict=True))


def test_run_lists_that_cover_different_slot_counts_are_refused() -> None:
    with pytest.raises(PlanError, match="cover"):
        slot_runs.joint_runs([(0, 4)], [(0, 5)], 512, 512)


def test_empty_runs_and_runs_that_continue_each_other_are_merged() -> None:
    found = slot_runs.joint_runs([(0, 4), (4, 0), (4, 4), (20, 2)], [(100, 10)], 512, 512)
    assert found.runs.table.tolist() == [[0, 8], [0, 20], [100, 108], [8, 2]]
    assert (found.host_runs, found.device_runs) == (2, 1)
