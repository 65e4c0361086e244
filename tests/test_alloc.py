"""Tests of kvtier.alloc.HostSlotAllocator: both policies, several page sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.errors import AllocatorCorruptError, InvariantError, SlotError

POLICIES = ["contiguous", "first_fit"]
PAGE_SIZES = [1, 4, 16]


# ---------------------------------------------------------------- helpers


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()


def run_of(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def extents(slots: list[int]) -> list[tuple[int, int]]:
    """Split a slot list into maximal ascending consecutive pieces: (start, length)."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def free_runs_of(free: set[int]) -> list[tuple[int, int]]:
    """Maximal runs (start, length) of a set of ints, by start."""
    return extents(sorted(free))


def check_handout(a: HostSlotAllocator, t: torch.Tensor, n: int) -> list[int]:
    """Shape, dtype, range, distinctness and whole pages of one alloc result."""
    assert isinstance(t, torch.Tensor)
    assert t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu"
    got = ids(t)
    assert len(got) == n
    assert len(set(got)) == n
    assert all(0 <= s < a.num_slots for s in got)
    ps = a.page_size
    for i in range(0, n, ps):
        page = got[i : i + ps]
        assert page[0] % ps == 0
        assert page == run_of(page[0], ps)
    return got


def twins(policy: str, ps: int, pages: int = 32) -> tuple[HostSlotAllocator, HostSlotAllocator]:
    """Two allocators driven through the same fragmenting history."""
    pair = (HostSlotAllocator(pages * ps, ps, policy), HostSlotAllocator(pages * ps, ps, policy))
    for a in pair:
        live = [a.alloc(k * ps) for k in (3, 1, 4, 1, 5, 9, 2)]
        a.free(live[1])
        a.free(live[4])
        a.free(live[3].flip(0))
    return pair


def assert_same(a: HostSlotAllocator, b: HostSlotAllocator) -> None:
    """`a` and `b` have the same free slots and answer the next allocations alike."""
    assert a.available() == b.available()
    assert a.free_runs() == b.free_runs()
    assert a.largest_free_run() == b.largest_free_run()
    a.check_invariants()
    b.check_invariants()
    ps = a.page_size
    ra, rb = a.alloc(ps), b.alloc(ps)
    assert ra is not None and rb is not None and torch.equal(ra, rb)
    rest = a.available()
    ra, rb = a.alloc(rest), b.alloc(rest)
    assert ra is not None and rb is not None and torch.equal(ra, rb)
    assert a.available() == b.available() == 0


# ---------------------------------------------------------------- construction


def test_constructor_accepts_enum_and_string() -> None:
    a = HostSlotAllocator(8, 2, AllocPolicy.FIRST_FIT)
    b = HostSlotAllocator(8, 2, "first_fit")
    assert a.policy is b.policy is AllocPolicy.FIRST_FIT
    c = HostSlotAllocator(8)
    assert (c.num_slots, c.page_size, c.policy) == (8, 1, AllocPolicy.CONTIGUOUS)
    assert c.available() == 8


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((8, 1, "best"), "'best'"),
        ((0, 1), "0"),
        ((-4, 1), "-4"),
        ((8, 0), "0"),
        ((8, -2), "-2"),
        ((10, 4), "10"),
        ((8.0, 1), "8.0"),
    ],
)
def test_constructor_errors(args: tuple, needle: str) -> None:
    with pytest.raises(SlotError, match=needle):
        HostSlotAllocator(*args)


# ---------------------------------------------------------------- basics per policy/page


@pytest.fixture(params=[(p, s) for p in POLICIES for s in PAGE_SIZES], ids=str)
def cfg(request: pytest.FixtureRequest) -> tuple[str, int]:
    return request.param


def test_alloc_free_basics(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a = HostSlotAllocator(16 * ps, ps, policy)
    assert a.available() == 16 * ps
    assert a.free_runs() == 1 and a.largest_free_run() == 16 * ps
    x = check_handout(a, a.alloc(3 * ps), 3 * ps)
    y = check_handout(a, a.alloc(ps), ps)
    assert not set(x) & set(y)
    assert a.available() == 12 * ps
    # A fresh pool hands out pages in order under both policies.
    assert x + y == run_of(0, 4 * ps)
    a.free(torch.tensor(x))
    assert a.available() == 15 * ps
    a.free(y)  # a list of ints works too
    assert a.available() == 16 * ps
    a.check_invariants()


def test_alloc_runs_describe_exactly_the_slots_handed_out(cfg: tuple[str, int]) -> None:
    """After churn, the runs `alloc_runs` reports expand to its slots, in order, each run maximal or split."""
    policy, ps = cfg
    a = HostSlotAllocator(64 * ps, ps, policy)
    rng = random.Random(7)
    live: list[torch.Tensor] = []
    for _ in range(200):
        if live and (rng.random() < 0.5 or a.available() < 8 * ps):
            a.free(live.pop(rng.randrange(len(live))))
            continue
        got = a.alloc_runs(rng.randint(1, 8) * ps)
        assert got is not None
        slots, runs = got
        assert sum(n for _, n in runs) == len(slots)
        assert [s for start, n in runs for s in range(start, start + n)] == slots.tolist()
        live.append(slots)
    a.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_one_run_allocations_are_views_of_an_unchanging_id_table(ps: int) -> None:
    """Contiguous policy: one-run slots are read from one table of ids, never rebuilt, and stay exact."""
    a = HostSlotAllocator(64 * ps, ps, "contiguous")
    x = a.alloc(16 * ps)
    y = a.alloc(8 * ps)
    # Slot s of every one-run allocation sits at the same place of one table: base + 8 * s.
    base = x.data_ptr()
    assert y.data_ptr() == base + 8 * 16 * ps
    a.free(x)
    z = a.alloc(40 * ps)  # the free space after y, not the freed head: still one run
    assert z.data_ptr() == base + 8 * 24 * ps
    for t, lo in ((y, 16 * ps), (z, 24 * ps)):
        assert t.tolist() == list(range(lo, lo + len(t)))
    a.free(torch.cat([y, z]))
    w = a.alloc(64 * ps)
    assert w.data_ptr() == base and w.tolist() == list(range(64 * ps))
    a.check_invariants()


def test_free_accepts_any_integer_dtype(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a = HostSlotAllocator(8 * ps, ps, policy)
    t = a.alloc(2 * ps)
    a.free(t.to(torch.int32))
    assert a.available() == 8 * ps


def test_none_exactly_when_short(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a = HostSlotAllocator(10 * ps, ps, policy)
    assert a.alloc(11 * ps) is None
    assert a.available() == 10 * ps
    live = [a.alloc(k * ps) for k in (4, 3, 2)]
    assert a.available() == ps
    assert a.alloc(2 * ps) is None
    assert a.available() == ps
    last = a.alloc(ps)
    assert last is not None and a.available() == 0
    assert a.alloc(ps) is None
    a.free(live[0])
    a.free(live[2])
    # Six free pages in two runs (4 + 2): six fit, seven do not.
    assert a.alloc(7 * ps) is None
    got = a.alloc(6 * ps)
    assert got is not None and len(got) == 6 * ps and a.available() == 0


def test_free_empty_is_noop(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a, b = twins(policy, ps)
    a.free(torch.empty(0, dtype=torch.int64))
    a.free([])
    assert_same(a, b)


def test_alloc_bad_sizes_change_nothing(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a, b = twins(policy, ps)
    bad: list[object] = [0, -ps, 1.0 * ps, True, str(ps), None]
    if ps > 1:
        bad += [1, ps + 1, 2 * ps - 1]
    for n in bad:
        with pytest.raises(SlotError):
            a.alloc(n)  # type: ignore[arg-type]
    assert_same(a, b)


def _free_error_cases(a: HostSlotAllocator) -> list[tuple[str, list[int], str]]:
    """(name, slots, text the message must hold) for `a` after `twins` history."""
    ps, n = a.page_size, a.num_slots
    # twins: pages [0,3) live, [3,4) freed, [4,8) live, [8,9) freed, [9,14) freed,
    # [14,23) live, [23,25) live, [25,32) never allocated.
    live_page = run_of(0, ps)
    freed_page = run_of(3 * ps, ps)
    never_page = run_of(30 * ps, ps)
    cases = [
        ("out of range high", [*live_page, n], str(n)),
        ("out of range low", [-1, *live_page], "-1"),
        ("repeated", live_page + live_page[:1], "repeats"),
        ("double free", live_page + freed_page, "double free"),
        ("never allocated", never_page + live_page, "never allocated"),
    ]
    if ps > 1:
        cases.append(("partial page", live_page[:-1], "partial"))
        cases.append(("partial page across", run_of(ps // 2, ps), "partial"))
    return cases


def test_free_errors_change_nothing(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a, b = twins(policy, ps)
    for name, slots, needle in _free_error_cases(a):
        for arg in (slots, torch.tensor(slots, dtype=torch.int64)):
            with pytest.raises(SlotError, match=needle):
                a.free(arg)
            assert a.available() == b.available(), name
    assert_same(a, b)


def test_free_error_names_ids_and_kinds(cfg: tuple[str, int]) -> None:
    policy, ps = cfg
    a = HostSlotAllocator(64 * ps, ps, policy)
    a.alloc(7 * ps)  # so the ids below are distinctive in a message
    t = a.alloc(4 * ps)
    a.free(t[: 2 * ps])
    never = 40 * ps + 1  # inside a never-allocated page
    with pytest.raises(SlotError) as err:
        a.free(torch.cat([t[2 * ps :], t[:ps]]))
    msg = str(err.value)
    assert "double free" in msg and str(int(t[0])) in msg
    if ps == 1:
        with pytest.raises(SlotError) as err:
            a.free([never])
        assert "never allocated" in str(err.value) and str(never) in str(err.value)
    # Many offenders: a bounded list plus a count.
    with pytest.raises(SlotError) as err:
        a.free(list(range(64 * ps, 64 * ps + 50)))
    msg = str(err.value)
    assert "50 in all" in msg and str(64 * ps + 11) not in msg
    assert a.available() == 55 * ps


def test_free_rejects_non_integer_or_2d() -> None:
    a = HostSlotAllocator(8)
    t = a.alloc(4)
    for bad in (t.float(), t.bool(), t.reshape(2, 2), [0.0, 1.0]):
        with pytest.raises(SlotError):
            a.free(bad)  # type: ignore[arg-type]
    assert a.available() == 4
    a.free(t)
    assert a.available() == 8


def test_free_does_not_alias_caller_tensor() -> None:
    # first_fit keeps freed ids; the caller reusing its tensor must not change them.
    a = HostSlotAllocator(8, 1, "first_fit")
    t = a.alloc(8)
    freed = t[:3].clone()
    a.free(freed)
    freed.fill_(7)
    assert ids(a.alloc(3)) == [0, 1, 2]


# ---------------------------------------------------------------- contiguous placement


def test_seed_scenario() -> None:
    a = HostSlotAllocator(10)
    assert ids(a.alloc(10)) == run_of(0, 10)
    a.free(torch.tensor([0, 1]))
    a.free(torch.tensor([6, 7, 8, 9]))
    assert ids(a.alloc(4)) == [6, 7, 8, 9]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_seed_scenario_first_fit_scrambles(ps: int) -> None:
    a = HostSlotAllocator(10 * ps, ps, "first_fit")
    a.alloc(10 * ps)
    a.free(torch.tensor(run_of(0, 2 * ps)))
    a.free(torch.tensor(run_of(6 * ps, 4 * ps)))
    # The FIFO hands the oldest freed pages out first: [0, 1] then [6, 7].
    assert ids(a.alloc(4 * ps)) == run_of(0, 2 * ps) + run_of(6 * ps, 2 * ps)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_first_fit_appends_in_given_order(ps: int) -> None:
    a = HostSlotAllocator(10 * ps, ps, "first_fit")
    a.alloc(10 * ps)
    a.free(run_of(3 * ps, ps) + run_of(ps, ps))
    a.free(run_of(7 * ps, ps))
    assert ids(a.alloc(3 * ps)) == run_of(3 * ps, ps) + run_of(ps, ps) + run_of(7 * ps, ps)


def _runs_8_4_16(ps: int) -> HostSlotAllocator:
    """Free runs of 8, 4 and 16 pages at pages 0, 10 and 20; the rest allocated."""
    a = HostSlotAllocator(40 * ps, ps)
    a.alloc(40 * ps)
    a.free(run_of(20 * ps, 16 * ps))
    a.free(run_of(0, 8 * ps))
    a.free(run_of(10 * ps, 4 * ps))
    assert a.free_runs() == 3 and a.largest_free_run() == 16 * ps
    return a


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_best_fit(ps: int) -> None:
    a = _runs_8_4_16(ps)
    assert ids(a.alloc(4 * ps)) == run_of(10 * ps, 4 * ps)
    assert ids(a.alloc(5 * ps)) == run_of(0, 5 * ps)
    # Left: 3 pages at 5 and 16 at 20; 3 fits exactly, 4 goes to the 16-run.
    assert ids(a.alloc(4 * ps)) == run_of(20 * ps, 4 * ps)
    assert ids(a.alloc(3 * ps)) == run_of(5 * ps, 3 * ps)
    a.check_invariants()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_fragmented_gathers_largest_first(ps: int) -> None:
    a = _runs_8_4_16(ps)
    got = ids(a.alloc(26 * ps))
    assert got == run_of(20 * ps, 16 * ps) + run_of(0, 8 * ps) + run_of(10 * ps, 2 * ps)
    assert a.available() == 2 * ps and a.free_runs() == 1
    assert ids(a.alloc(2 * ps)) == run_of(12 * ps, 2 * ps)
    a.check_invariants()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_free_merges_both_neighbours(ps: int) -> None:
    a = HostSlotAllocator(12 * ps, ps)
    parts = [a.alloc(k * ps) for k in (2, 3, 2, 5)]
    a.free(parts[0])
    a.free(parts[2])
    assert a.free_runs() == 2
    a.free(parts[1])  # bridges the two free runs
    assert a.free_runs() == 1 and a.largest_free_run() == 7 * ps
    a.free(parts[3])
    assert a.free_runs() == 1 and a.largest_free_run() == 12 * ps
    a.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_everything_freed_is_one_run(policy: str, ps: int) -> None:
    rng = random.Random(1234)
    a = HostSlotAllocator(256 * ps, ps, policy)
    live: list[torch.Tensor] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            t = a.alloc(rng.randint(1, 24) * ps)
            if t is not None:
                live.append(t)
    a.check_invariants()
    rng.shuffle(live)
    for t in live:
        a.free(t[torch.randperm(len(t), generator=torch.Generator().manual_seed(7))])
    assert a.available() == a.num_slots
    assert a.free_runs() == 1
    assert a.largest_free_run() == a.num_slots
    a.check_invariants()


# ---------------------------------------------------------------- double allocation


def test_double_allocation_detected_in_any_run() -> None:
    # Corrupt the run store so a run whose last page is still allocated looks free,
    # and make it the best fit rather than the first run: the check must cover every
    # page of every chosen run. (The fault is injected through private state: no public
    # call can corrupt the allocator.)
    a = HostSlotAllocator(32)
    a.alloc(32)
    a.free(run_of(0, 8))
    a.free([20, 21])
    a._remove_run(20, 2)
    a._add_run(20, 3)  # page 22 is live
    a._free_pages += 1
    with pytest.raises(InvariantError, match="allocator invariant broken"):
        a.check_invariants()
    with pytest.raises(AllocatorCorruptError, match=r"double allocation.*\[22\]"):
        a.alloc(3)
    assert a.free_runs() == 2 and a.largest_free_run() == 8 and a.available() == 11
    assert a.allocated_mask()[20:23].tolist() == [False, False, True]
    # The gather path checks every run too.
    with pytest.raises(AllocatorCorruptError):
        a.alloc(11)
    assert a.free_runs() == 2 and a.available() == 11
    assert a.allocated_mask()[:8].sum() == 0


def test_double_allocation_detected_past_fifo_head() -> None:
    a = HostSlotAllocator(16, 1, "first_fit")
    a.alloc(16)
    a.free([4, 5])
    a._segments.append(np.array([9], dtype=np.int64))  # page 9 is live (injected fault)
    a._free_pages += 1
    with pytest.raises(InvariantError, match="allocator invariant broken"):
        a.check_invariants()
    with pytest.raises(AllocatorCorruptError, match="double allocation"):
        a.alloc(3)
    assert a.available() == 3
    assert ids(a.alloc(2)) == [4, 5]  # the head was not consumed by the failed call


# ---------------------------------------------------------------- stateful model


class AllocMachine(RuleBasedStateMachine):
    """The allocator against a model: a set of free slots and the live allocations."""

    policy = "contiguous"
    page_size = 1
    num_pages = 32

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.a = HostSlotAllocator(self.num_pages * ps, ps, self.policy)
        self.free_pages: set[int] = set(range(self.num_pages))
        self.freed_pages: set[int] = set()  # free again after an allocation
        self.fifo: list[int] = list(range(self.num_pages))  # first_fit model order
        self.live: list[list[int]] = []  # page lists of live allocations

    # -- helpers

    def _free_model(self, pages: list[int]) -> None:
        self.free_pages |= set(pages)
        self.freed_pages |= set(pages)
        self.fifo.extend(pages)

    def _slots(self, pages: list[int]) -> list[int]:
        ps = self.page_size
        return [p * ps + o for p in pages for o in range(ps)]

    # -- rules

    @rule(k=st.integers(1, 12))
    def alloc(self, k: int) -> None:
        ps = self.page_size
        runs = free_runs_of(self.free_pages)
        t = self.a.alloc(k * ps)
        if len(self.free_pages) < k:
            assert t is None
            return
        assert t is not None
        got = check_handout(self.a, t, k * ps)
        pages = [s // ps for s in got[::ps]]
        live_slots = {s for p in self.live for s in self._slots(p)}
        assert not set(got) & live_slots, "handed out a live slot"
        assert set(pages) <= self.free_pages
        if self.policy == "contiguous":
            self._check_placement(pages, runs, k)
        else:
            assert pages == self.fifo[:k]
            del self.fifo[:k]
        self.free_pages -= set(pages)
        self.freed_pages -= set(pages)
        self.live.append(pages)

    def _check_placement(self, pages: list[int], runs: list[tuple[int, int]], k: int) -> None:
        fitting = [n for _, n in runs if n >= k]
        got = extents(pages)
        starts = dict(runs)
        if fitting:
            # One ascending run, from the start of a smallest run that fits.
            assert len(got) == 1
            assert starts.get(got[0][0]) == min(fitting)
            return
        # Otherwise the largest runs, whole, largest first; the last from its start.
        by_size = sorted((n for _, n in runs), reverse=True)
        assert all(s in starts for s, _ in got)
        assert [starts[s] for s, _ in got] == by_size[: len(got)]
        assert all(n == starts[s] for s, n in got[:-1])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_whole(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.live) - 1))
        pages = self.live.pop(i)
        if data.draw(st.booleans()):
            pages = data.draw(st.permutations(pages))
        self.a.free(torch.tensor(self._slots(pages), dtype=torch.int64))
        self._free_model(pages)

    @precondition(lambda self: any(len(p) > 1 for p in self.live))
    @rule(data=st.data())
    def free_part(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([j for j, p in enumerate(self.live) if len(p) > 1]))
        pages = self.live[i]
        part = data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=len(pages) - 1, unique=True))
        self.a.free(self._slots(part))
        self.live[i] = [p for p in pages if p not in part]
        self._free_model(part)

    @rule(data=st.data())
    def bad_free(self, data: st.DataObject) -> None:
        ps, n = self.page_size, self.a.num_slots
        never = sorted(self.free_pages - self.freed_pages)
        kinds = ["range", "repeat"]
        if self.freed_pages:
            kinds.append("double")
        if never:
            kinds.append("never")
        if ps > 1 and self.live:
            kinds.append("partial")
        kind = data.draw(st.sampled_from(kinds))
        # Sometimes mix in a valid live page: it must not be freed either.
        good = self._slots([data.draw(st.sampled_from(self.live))[0]]) if self.live else []
        if not data.draw(st.booleans()):
            good = []
        if kind == "range":
            bad = [data.draw(st.sampled_from([-1, n, n + ps, -ps]))]
        elif kind == "repeat":
            bad = [good[-1]] if good else [0, 0]
        elif kind == "double":
            bad = self._slots([data.draw(st.sampled_from(sorted(self.freed_pages)))])
        elif kind == "never":
            bad = self._slots([data.draw(st.sampled_from(never))])
        else:
            page = self._slots([data.draw(st.sampled_from(self.live))[0]])
            bad = page[: data.draw(st.integers(1, ps - 1))]
            good = [s for s in good if s not in page]
        slots = good + bad
        with pytest.raises(SlotError):
            self.a.free(torch.tensor(data.draw(st.permutations(slots)), dtype=torch.int64))

    # -- invariants

    @invariant()
    def counts_match(self) -> None:
        assert self.a.available() == len(self.free_pages) * self.page_size
        self.a.check_invariants()
        if self.policy == "contiguous":
            runs = free_runs_of(self.free_pages)
            assert self.a.free_runs() == len(runs)
            assert self.a.largest_free_run() == max((n for _, n in runs), default=0) * (self.page_size)


MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(policy: str, ps: int) -> type[RuleBasedStateMachine]:
    return type(
        f"AllocMachine_{policy}_{ps}",
        (AllocMachine,),
        {"policy": policy, "page_size": ps, "num_pages": 32},
    )


def _machine_test(policy: str, ps: int) -> type:
    case = _machine(policy, ps).TestCase
    case.settings = MACHINE_SETTINGS
    return case


TestContiguous1 = _machine_test("contiguous", 1)
TestContiguous4 = _machine_test("contiguous", 4)
TestContiguous16 = _machine_test("contiguous", 16)
TestFirstFit1 = _machine_test("first_fit", 1)
TestFirstFit4 = _machine_test("first_fit", 4)
TestFirstFit16 = _machine_test("first_fit", 16)


# ---------------------------------------------------------------- same capacity


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 20)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("half"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, ps=st.sampled_from(PAGE_SIZES))
def test_policies_have_same_capacity(ops: list[tuple[str, int]], ps: int) -> None:
    """Both policies fail exactly on the same calls of one alloc/free sequence."""
    pools = [HostSlotAllocator(48 * ps, ps, p) for p in POLICIES]
    lives: list[list[torch.Tensor]] = [[], []]
    for op, arg in ops:
        if op == "alloc":
            short = pools[0].available() < arg * ps
            got = [a.alloc(arg * ps) for a in pools]
            assert (got[0] is None) == (got[1] is None) == short
            if got[0] is not None:
                for live, t in zip(lives, got, strict=True):
                    live.append(t)
        elif lives[0]:
            i = arg % len(lives[0])
            for a, live in zip(pools, lives, strict=True):
                t = live.pop(i)
                if op == "half" and len(t) > ps:
                    # Free a page-aligned first part; keep the rest live.
                    cut = (len(t) // ps // 2) * ps
                    a.free(t[:cut])
                    live.append(t[cut:])
                else:
                    a.free(t)
        assert pools[0].available() == pools[1].available()
