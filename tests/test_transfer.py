"""Every transfer path against a per-token reference, byte for byte, with poisoned destinations; what
each plan's parts move and what plans refuse; `Transfers.submit` on a deferred CPU lane."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from conftest import host_row, poison_device, poison_host, random_rows, run_and_check, same_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import jit
from kvtier.errors import ConfigError, PlanError, SlotError, SpecError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.chunks import HostChunks
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import (
    KernelOptions,
    PathCosts,
    Planner,
    TransferPath,
    TransferPlan,
    backup,
    cudart,
    kernels,
    load_layer,
    load_layers,
    rule,
)
from kvtier.transfer import runs as slot_runs
from kvtier.transfer.lanes import DeferredLane
from kvtier.transfer.parts import CopyPart, KernelPart, ReferencePart
from kvtier.transfer.submit import Operation, Transfers

SPECS = ["tiny-mha", "tiny-mha-fp16", "tiny-mla", "tiny-mla-fp8", "tiny-dsa"]
PAGE_SIZES = [1, 16, 64]
HOST_SLOTS = 256
DEVICE_SLOTS = 192
TOKENS = 128

needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's CPU interpreter"
)


def slot_case(case: str, ps: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Host/device slot lists, from one run to fully scattered (host slots in whole pages)."""
    host_run = torch.arange(64, 64 + TOKENS)
    runs_of_16 = (
        torch.randperm(HOST_SLOTS // 16, generator=gen)[: TOKENS // 16, None] * 16 + torch.arange(16)
    ).flatten()
    pages = torch.randperm(HOST_SLOTS // ps, generator=gen)[: TOKENS // ps]
    scattered_host = (pages[:, None] * ps + torch.arange(ps)).flatten()
    dev_run = torch.arange(32, 32 + TOKENS)
    dev_scattered = torch.randperm(DEVICE_SLOTS, generator=gen)[:TOKENS]
    return {
        "one-run": (host_run, dev_run),
        "host-run-device-scattered": (host_run, dev_scattered),
        "runs-of-16": (runs_of_16, dev_run),
        "runs-of-16-device-scattered": (runs_of_16, dev_scattered),
        "scattered": (scattered_host, dev_scattered),
    }[case]


def _runs_of(slots: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal ascending runs of `slots`, cut arbitrarily more (callers may hand over split runs)."""
    out: list[tuple[int, int]] = []
    for s in slots.tolist():
        if out and out[-1][0] + out[-1][1] == s and len(out) % 3:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


# How a case plans: the planner on its own (on CPU: copies or the reference path), the planner allowed
# the kernel (its rule between copies and kernel), or one path forced.
PATHS = ["planned", "planned-kernel", "copy", "kernel", "reference"]


def planner_for(path: str, host: HostPool, dev: DevicePool, **kw) -> Planner:
    if path == "planned":
        return Planner(host, dev, **kw)
    if path == "planned-kernel":
        return Planner(host, dev, use_kernel=True, **kw)
    return Planner(host, dev, force=path, **kw)


# Every value of each factor of the byte-identity test; each pair of values of two factors
# appears in at least one case (`pairwise`), instead of the full product.
FACTORS: dict[str, list] = {
    "spec": SPECS,
    "ps": PAGE_SIZES,
    "layout": list(HostLayout),
    "path": PATHS,
    "direction": ["load", "backup"],
    "case": [
        "one-run",
        "host-run-device-scattered",
        "runs-of-16",
        "runs-of-16-device-scattered",
        "scattered",
    ],
    "planned_from": ["slots", "run lists"],
    "calls": ["per layer", "all layers"],
}


def required_pairs(factors: dict[str, list]) -> set[tuple]:
    names = list(factors)
    return {
        ((a, repr(va)), (b, repr(vb)))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for va in factors[a]
        for vb in factors[b]
    }


def pairs_of(row: dict) -> set[tuple]:
    names = list(row)
    return {((a, repr(row[a])), (b, repr(row[b]))) for i, a in enumerate(names) for b in names[i + 1 :]}


def pairwise(factors: dict[str, list]) -> list[dict]:
    """Cases covering every pair of values of two factors (greedy, deterministic).

    Each case starts from an uncovered pair of the two factors with the most uncovered pairs
    left (every such pair is tried) and takes, factor by factor, the value that covers the
    most uncovered pairs (the least used on a tie); the case covering the most is kept.
    """
    uncovered = required_pairs(factors)
    rows: list[dict] = []
    used: collections.Counter = collections.Counter()

    def complete(seed: dict) -> dict:
        row = dict(seed)
        for name in factors:
            if name not in row:
                row[name] = max(
                    factors[name],
                    key=lambda v: (len(pairs_of({**row, name: v}) & uncovered), -used[name, repr(v)]),
                )
        return {name: row[name] for name in factors}

    while uncovered:
        kinds = collections.Counter((a, b) for (a, _), (b, _) in uncovered)
        kind = max(sorted(kinds), key=kinds.__getitem__)
        seeds = sorted(p for p in uncovered if (p[0][0], p[1][0]) == kind)
        candidates = []
        for (a, ra), (b, rb) in seeds:
            va = next(v for v in factors[a] if repr(v) == ra)
            vb = next(v for v in factors[b] if repr(v) == rb)
            candidates.append(complete({a: va, b: vb}))
        row = max(candidates, key=lambda r: len(pairs_of(r) & uncovered))
        rows.append(row)
        uncovered -= pairs_of(row)
        used.update((name, repr(v)) for name, v in row.items())
    return rows


CASES = pairwise(FACTORS)


def test_the_cases_cover_every_pair_of_values() -> None:
    covered = set().union(*(pairs_of(c) for c in CASES))
    assert required_pairs(FACTORS) <= covered
    assert len(CASES) < 60  # far fewer than the product of the factors


def _case_id(c: dict) -> str:
    extra = ("-runs" if c["planned_from"] == "run lists" else "") + (
        "-grouped" if c["calls"] != "per layer" else ""
    )
    return f"{c['spec']}-{c['ps']}-{c['layout'].value}-{c['path']}-{c['direction']}-{c['case']}{extra}"


def snapshot(host: HostPool, dev: DevicePool) -> dict:
    """Every row of both tiers, copied: `(tier, buffer, layer)` -> `[slots, *row]`."""
    every = torch.arange(host.num_slots)
    out = {}
    for b in host.spec.buffers:
        for layer in b.layers:
            out["host", b.name, layer] = host.gather(b.name, layer, every).clone()
            out["dev", b.name, layer] = dev.layer(b.name, layer).cpu().clone()
    return out


def run_plan(plan: TransferPlan, host: HostPool, dev: DevicePool, grouped: bool = False, stream=None) -> None:
    """Every layer of `plan`: loads layer by layer (or all in one `load_layers` call), backups in one call."""
    layers = range(host.spec.num_layers)
    if plan.direction is Direction.BACKUP:
        backup(plan, dev, host, stream=stream)
    elif grouped:
        load_layers(plan, host, dev, layers, stream)
    else:
        for layer in layers:
            load_layer(plan, host, dev, layer, stream)
    if stream is not None:
        stream.synchronize()


def check_moved(plan: TransferPlan, host: HostPool, dev: DevicePool, before: dict) -> None:
    """After `plan` ran: the destination tier holds `before` with exactly the pairs' rows replaced by
    the source's, byte for byte; the source tier is unchanged."""
    hs, ds = plan.host_slots, plan.device_slots
    after = snapshot(host, dev)
    src, dst = ("host", "dev") if plan.direction is Direction.LOAD else ("dev", "host")
    src_at, dst_at = (hs, ds) if plan.direction is Direction.LOAD else (ds, hs)
    for b in host.spec.buffers:
        for layer in b.layers:
            want = before[dst, b.name, layer].clone()
            want[dst_at] = before[src, b.name, layer][src_at]
            assert same_bytes(after[dst, b.name, layer], want), (plan.path, b.name, layer)
            assert same_bytes(after[src, b.name, layer], before[src, b.name, layer]), (
                plan.path,
                b.name,
                layer,
            )


def moved_device_slots(plan: TransferPlan, name: str) -> dict[str, list[int]]:
    """Per mechanism, the device slots (with repeats) that the plan's parts move for buffer `name`, read
    from the parts: copy runs, kernel units (each launch's device word offsets), reference positions."""
    b = plan.host_pool.spec.buffer(name)
    out: dict[str, list[int]] = collections.defaultdict(list)
    for p in plan.parts:
        if name not in p.buffers:
            continue
        if isinstance(p, CopyPart):
            for d, n in zip(p.runs.device.tolist(), p.runs.length.tolist(), strict=True):
                out["copy"] += range(d, d + n)
        elif isinstance(p, KernelPart):
            launches = p.by_buffer[name].launches
            firsts = set()
            for launch_ in launches:
                shape = launch_.shape
                unit_bytes = shape.row_vecs * shape.kwargs["VEC"] * shape.word
                assert unit_bytes % b.row_bytes == 0
                dev_off = launch_.dst_off if plan.direction is Direction.LOAD else launch_.src_off
                slots = (dev_off.cpu().numpy() * shape.word // b.row_bytes).tolist()
                firsts.add((unit_bytes // b.row_bytes, tuple(slots)))
            assert len(firsts) == 1  # every layer class moves the same device rows
            ((unit, slots),) = firsts
            out["kernel"] += [s + i for s in slots for i in range(unit)]
        else:
            assert isinstance(p, ReferencePart)
            out["reference"] += plan.device_slots[p.positions].tolist()
    return out


def check_parts(plan: TransferPlan) -> None:
    """Every row of every buffer is moved by exactly one part; the copy runs are whole joint runs of the
    plan and the kernel moves exactly the rest of them."""
    host, n = plan.host_pool, plan.num_tokens
    joint = slot_runs.scan(host, plan.host_slots.numpy(), plan.device_slots.numpy(), 1).runs
    assert plan.joint_runs == len(joint)
    columns = {tuple(c) for c in joint.table.T.tolist()}
    for b in host.spec.buffers:
        assert sum(plan.mechanisms_by_buffer()[b.name].values()) == n
        by = moved_device_slots(plan, b.name)
        assert sorted(s for slots in by.values() for s in slots) == sorted(plan.device_slots.tolist())
        copied = [p for p in plan.parts if isinstance(p, CopyPart) and b.name in p.buffers]
        copy_cols = {tuple(c) for p in copied for c in p.runs.table.T.tolist()}
        assert copy_cols <= columns
        if "kernel" in by:
            rest = [c for c in joint.table.T.tolist() if tuple(c) not in copy_cols]
            assert sorted(by["kernel"]) == sorted(s for _, _, d, k in rest for s in range(d, d + k))


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_every_path_matches_the_reference(c: dict, gen) -> None:
    """A load or backup on every path is byte-identical to the layout's own rows; no other row of
    the poisoned destination changes, nor any row of the source."""
    if "kernel" in c["path"] and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    spec = preset(c["spec"], c["ps"])
    host = HostPool(spec, HOST_SLOTS, c["layout"])
    dev = DevicePool(spec, DEVICE_SLOTS)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = slot_case(c["case"], c["ps"], gen)
    planner = planner_for(c["path"], host, dev)
    if c["planned_from"] == "run lists":
        plan = planner.plan_allocated(c["direction"], hs, ds, runs=(_runs_of(hs), _runs_of(ds)))
    else:
        plan = planner.plan(c["direction"], hs, ds)
    if c["path"] in ("copy", "kernel", "reference"):
        assert plan.path is TransferPath(c["path"])
    elif c["path"] == "planned":
        assert plan.sms_used == 0  # no kernel unless allowed
    check_parts(plan)
    before = snapshot(host, dev)
    run_plan(plan, host, dev, grouped=c["calls"] == "all layers")
    check_moved(plan, host, dev, before)


class Arena:
    """`HostChunks._allocate` handing out views of one arena in a random order, with random gaps: a pool's
    regions then lie below as well as above its first region, so the kernel reads some of them at
    negative offsets from its base, and layers' regions lie apart by different distances."""

    def __init__(self, slot_bytes: int, slots: int, seed: int) -> None:
        self.raw = torch.zeros(slot_bytes * slots, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        rng = np.random.default_rng(seed)
        self.order = iter(rng.permutation(slots).tolist())
        self.gaps = rng.integers(0, 8, size=slots) * 16

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        slot = next(self.order)
        start = slot * self.slot_bytes + int(self.gaps[slot])
        assert nbytes + int(self.gaps[slot]) <= self.slot_bytes
        return self.raw[start : start + nbytes].view(dtype).view(shape)


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize(
    ("layout", "ps"), [("layer_first", 1), ("layer_first", 4), ("page_first", 1), ("page_first", 4)]
)
@pytest.mark.parametrize("arena", [False, True])
def test_the_kernel_reads_every_region_of_a_chunked_host_pool_from_one_base(
    layout, ps, direction, arena, gen, monkeypatch
) -> None:
    """Chunks of 2 KB: layer_first has several segments (and layer groups), page_first several chunks;
    the kernel, forced, moves scattered and run-wise slots byte for byte in both directions. With the
    arena, regions lie below the first one (negative offsets) and in several classes per buffer."""
    spec = preset("tiny-dsa", ps)
    if arena:
        monkeypatch.setattr(HostChunks, "_allocate", Arena(4096, 256, seed=ps).allocate)
    host = HostPool(spec, 256, layout, chunk_bytes=2048)
    assert all(len(host.chunks(b.name)) > 4 for b in spec.buffers)
    dev = DevicePool(spec, 256)
    if arena:
        classes = {b.name: host.region_classes(b.name)[0] for b in spec.buffers}
        assert any((c < 0).any() for c in classes.values())  # regions below the base
        if layout == "layer_first":
            assert any(len(c) > 1 for c in classes.values())  # layers whose regions lie apart differently
    pages = torch.randperm(256 // ps, generator=gen)[: 120 // ps]
    cases = [
        ((pages[:, None] * ps + torch.arange(ps)).flatten(), torch.randperm(256, generator=gen)[:120]),
        (torch.arange(10, 130), torch.arange(100, 220)),  # one host run over several segments
    ]
    for hs, ds in cases:
        poison_host(host, gen)
        poison_device(dev, gen)
        plan = Planner(host, dev, force="kernel").plan(direction, hs, ds)
        assert plan.path is TransferPath.KERNEL
        check_parts(plan)
        before = snapshot(host, dev)
        run_plan(plan, host, dev)
        check_moved(plan, host, dev, before)


def test_multi_chunk_host_pool_round_trip(gen) -> None:
    """Chunks of a few KiB force runs to split at segment boundaries; copies keep the data both ways."""
    spec = preset("tiny-dsa", 4)
    free_copies = PathCosts(python_copy_s=0.0)
    for layout in HostLayout:
        host = HostPool(spec, 512, layout, chunk_bytes=4096)
        assert len(host.chunks("kv")) > 1
        assert all(c.nbytes <= 4096 for c in host.chunks("kv"))
        dev = DevicePool(spec, 512)
        truth = {(b.name, lay): random_rows(512, b, gen) for b in spec.buffers for lay in b.layers}
        for (name, lay), rows in truth.items():
            dev.layer(name, lay).copy_(rows)
        hs = torch.arange(512)
        plan = TransferPlan.build("backup", host, dev, hs, torch.arange(512), costs=free_copies)
        assert plan.path is TransferPath.COPY and plan.joint_runs == host.num_segments()
        backup(plan, dev, host)
        poison_device(dev, gen)
        perm = torch.randperm(512, generator=gen)
        plan = TransferPlan.build("load", host, dev, hs, perm, costs=free_copies)
        assert plan.path is TransferPath.COPY
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer)
        for (name, lay), rows in truth.items():
            assert same_bytes(dev.layer(name, lay)[perm], rows), (layout, name, lay)


def rows_by_mechanism(plan: TransferPlan) -> dict[str, int]:
    """Rows each mechanism moves, summed over parts (a part of several buffers counts its rows once)."""
    out: dict[str, int] = {}
    for p in plan.parts:
        out[p.mechanism.value] = out.get(p.mechanism.value, 0) + p.rows
    return out


def _runs(starts, length) -> torch.Tensor:
    return (torch.tensor(starts)[:, None] * length + torch.arange(length)).flatten()


def test_without_the_kernel_few_long_runs_are_copied_and_single_rows_go_token_by_token() -> None:
    spec = preset("tiny-mla", 1)  # 48-byte rows
    host, dev = HostPool(spec, 16384), DevicePool(spec, 16384)
    planner = Planner(host, dev)
    assert not planner.kernel_ok  # a CPU pool: no kernel unless asked for

    def path(hs, ds) -> TransferPath:
        return planner.plan("load", hs, ds).path

    long_runs = _runs([7, 2, 4], 2048)  # 98 KB runs
    assert path(long_runs, torch.arange(len(long_runs))) is TransferPath.COPY
    single_rows = _runs(list(range(0, 8192, 2)), 1)
    assert path(single_rows, torch.arange(len(single_rows))) is TransferPath.REFERENCE
    assert path(torch.arange(100, 400), torch.arange(300)) is TransferPath.COPY  # one run: one copy
    # The choice follows the costs: a Python copy costing nothing makes copies pay even per row.
    free = Planner(host, dev, PathCosts(python_copy_s=0.0))
    assert free.plan("load", single_rows, torch.arange(len(single_rows))).path is TransferPath.COPY


@needs_triton
def test_with_the_kernel_long_runs_are_copied_and_short_ones_go_to_the_kernel() -> None:
    spec = preset("deepseek-v3", 1).with_layers(1)  # 1152-byte rows
    host, dev = HostPool(spec, 65536), DevicePool(spec, 65536)
    planner = Planner(host, dev, use_kernel=True)

    def plan(hs, ds) -> TransferPlan:
        return planner.plan("load", hs, ds)

    long_runs = _runs([3, 1, 5, 0], 8192)  # 9.4 MB each
    assert plan(long_runs, torch.arange(len(long_runs))).path is TransferPath.COPY
    assert plan(long_runs[::2], torch.arange(len(long_runs) // 2)).path is TransferPath.KERNEL
    assert plan(torch.arange(10, 20), torch.arange(10)).path is TransferPath.COPY  # one run
    short = 7 * 8192 + torch.randperm(8192, generator=torch.Generator().manual_seed(0))[:3000]
    mixed = plan(torch.cat([long_runs, short]), torch.arange(len(long_runs) + 3000))
    assert mixed.path is TransferPath.MIXED
    assert rows_by_mechanism(mixed) == {"copy": len(long_runs), "kernel": 3000}
    check_parts(mixed)
    with pytest.raises(PlanError, match="cannot be forced"):
        Planner(host, dev, force="mixed")


@needs_triton
def test_two_buffers_copy_every_run_where_that_beats_their_own_choices_together() -> None:
    """glm-5's rows (1152 + 132 bytes) in 500 host runs of 60-62 rows onto contiguous slots, as after
    churn: alone, the 132-byte buffer's runs (8 KB, under `copy_min_bytes`) would go to the kernel;
    the host issues their copies while the 1152-byte runs move, so every run of both is copied."""
    spec = preset("glm-5", 1).with_layers(1)
    host, dev = HostPool(spec, 40000), DevicePool(spec, 40000)
    lens = [60 + 2 * (i % 2) for i in range(500)]
    hs = torch.cat([torch.arange(i * 70, i * 70 + n) for i, n in enumerate(lens)])
    costs = PathCosts()
    arr = np.array(lens, dtype=np.int64)
    ordered = arr[rule.longest_first(arr)]
    alone = {
        b.name: int(
            np.argmin(
                rule.split_times(costs, ordered, b.row_bytes, rule.unit_rows(arr, b.row_bytes, 16 << 10))
            )
        )
        for b in spec.buffers
    }
    assert alone == {"kv": 500, "indexer": 0}
    plan = Planner(host, dev, costs, use_kernel=True).plan("load", hs, torch.arange(len(hs)))
    assert plan.path is TransferPath.COPY, plan.describe()
    assert plan.mechanisms_by_buffer() == {"kv": {"copy": len(hs)}, "indexer": {"copy": len(hs)}}
    # One buffer alone never takes the joint candidate: its own choice already weighs copying all.
    one = preset("deepseek-v3", 1).with_layers(1)
    single = Planner(HostPool(one, 40000), DevicePool(one, 40000), costs, use_kernel=True)
    assert single.plan("load", hs, torch.arange(len(hs))).path is TransferPath.COPY


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_a_mixed_plan_moves_its_copies_and_its_kernel_rows_byte_for_byte(direction, layout, gen) -> None:
    """A long joint run among single rows: with copies cheap but not free, the run is copied and the
    single rows go to the kernel (layer_first); page_first cuts host runs at every page: all kernel."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 1024, layout), DevicePool(spec, 1024)
    poison_host(host, gen)
    poison_device(dev, gen)
    short_host = torch.randperm(512, generator=gen)[:100]
    short_dev = torch.randperm(512, generator=gen)[:100] + 512
    hs = torch.cat([short_host[:50], torch.arange(512, 812), short_host[50:]])
    ds = torch.cat([short_dev[:50], torch.arange(0, 300), short_dev[50:]])
    # Per run: a copy costs 0.1 us more, the kernel 1/share - 1 of the bytes more: runs of over ~7 KB copy.
    costs = PathCosts(
        copy_fixed_s=1e-7, copy_call_s=0.0, copy_host_s=0.0, launch_fixed_s=0.0, copy_min_bytes=0, split_s=0.0
    )
    plan = Planner(host, dev, costs, use_kernel=True).plan(direction, hs, ds)
    if layout is HostLayout.LAYER_FIRST:
        assert plan.path is TransferPath.MIXED
        assert rows_by_mechanism(plan) == {"copy": 300, "kernel": 100}
        assert plan.mechanisms_by_buffer() == {
            name: {"copy": 300, "kernel": 100} for name in ("kv", "indexer")
        }
    else:
        assert plan.path is TransferPath.KERNEL
        assert rows_by_mechanism(plan) == {"kernel": 400}
    assert 0 < plan.sms_used <= plan.kernel.sm_budget
    check_parts(plan)
    before = snapshot(host, dev)
    run_plan(plan, host, dev)
    check_moved(plan, host, dev, before)


@pytest.mark.parametrize("force", [None, "copy", "kernel", "reference"])
def test_an_empty_plan_moves_nothing(force) -> None:
    if force == "kernel" and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    empty = torch.tensor([], dtype=torch.int64)
    for direction in ("load", "backup"):
        plan = Planner(host, dev, force=force).plan(direction, empty, empty)
        assert plan.path is (TransferPath(force) if force else TransferPath.COPY)
        assert plan.num_tokens == 0 and plan.sms_used == 0
        before = snapshot(host, dev)
        run_plan(plan, host, dev)
        check_moved(plan, host, dev, before)


def test_plan_counts_runs() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    plan = TransferPlan.build("load", host, dev, [0, 1, 2, 10, 11, 30], [5, 6, 9, 10, 11, 12])
    assert (plan.host_runs, plan.device_runs, plan.joint_runs) == (3, 2, 4)


@pytest.mark.parametrize("force", [None, "copy", "kernel", "reference"])
@pytest.mark.parametrize(
    ("direction", "hs", "ds", "message"),
    [
        ("load", [0, 1, 64], [0, 1, 2], "outside"),
        ("load", [0, 1, 2], [0, 1, -1], "outside"),
        ("load", [0, 1, 2], [0, 1], "entries"),
        ("load", [0, 1, 2], [3, 3, 4], "repeats"),
        ("backup", [5, 6, 5], [0, 1, 2], "repeats"),
        ("backup", [0, 1, 2], [0, 1, 64], "outside"),
    ],
)
def test_bad_slots_raise_before_anything_is_written(direction, hs, ds, message, force, gen) -> None:
    if force == "kernel" and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    poison_host(host, gen)
    poison_device(dev, gen)
    before = snapshot(host, dev)
    with pytest.raises(SlotError, match=message):
        Planner(host, dev, force=force, use_kernel=True).plan(direction, hs, ds)
    after = snapshot(host, dev)
    assert all(same_bytes(after[k], v) for k, v in before.items())


def test_backup_rejects_repeated_host_slots_but_load_allows_repeated_sources(gen) -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(SlotError, match="host_slots"):
        TransferPlan.build("backup", host, dev, [1, 1], [2, 3])
    poison_host(host, gen)
    poison_device(dev, gen)
    plan = TransferPlan.build("load", host, dev, [1, 1], [2, 3])  # one host row to two device slots is fine
    before = snapshot(host, dev)
    run_plan(plan, host, dev)
    check_moved(plan, host, dev, before)


def test_bad_index_tensors_and_plans_of_the_other_direction_raise() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(SlotError, match="integer"):
        TransferPlan.build("load", host, dev, torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(SlotError, match="1-D"):
        TransferPlan.build("load", host, dev, torch.tensor([[1]]), torch.tensor([1]))
    with pytest.raises(PlanError, match="cannot be forced"):
        TransferPlan.build("load", host, dev, [1, 5], [1, 2], force="mixed")
    with pytest.raises(ValueError):
        TransferPlan.build("load", host, dev, [1], [1], force="single_copy")
    plan = TransferPlan.build("load", host, dev, [1], [1])
    with pytest.raises(PlanError, match="plan is for load"):
        backup(plan, dev, host)


def test_the_kernel_cannot_be_forced_where_it_cannot_run(monkeypatch) -> None:
    """A CPU pool without Triton's interpreter: forcing the kernel is refused, and a planner allowed it
    makes no kernel part."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not jit.interpreting() and not kernels.runs_on(torch.device("cpu"))
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    with pytest.raises(PlanError, match="kernel path needs Triton"):
        Planner(host, dev, force="kernel")
    planner = Planner(host, dev, use_kernel=True)
    assert not planner.kernel_ok
    plan = planner.plan("load", torch.randperm(256)[:100], torch.arange(100))
    assert plan.sms_used == 0 and "kernel" not in rows_by_mechanism(plan)


def test_mismatched_specs_are_refused() -> None:
    host = HostPool(preset("tiny-mla"), 64)
    dev = DevicePool(preset("tiny-mha"), 64)
    with pytest.raises(PlanError, match="different buffers"):
        TransferPlan.build("load", host, dev, [1], [1])
    with pytest.raises(PlanError, match="different buffers"):
        Transfers(host, dev)
    # Another spec object of the same shapes is fine.
    TransferPlan.build("load", HostPool(preset("tiny-mla"), 64), DevicePool(preset("tiny-mla"), 64), [1], [1])


def test_wrapped_engine_tensors_fall_back_to_reference(gen) -> None:
    """Rows not packed (a `[slots, 2, heads, dim]` KV tensor) or another dtype: the reference path, exact."""
    spec = preset("tiny-mha", 1)
    host = HostPool(spec, 64)
    poison_host(host, gen)
    kv = [torch.zeros(48, 2, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    dev = DevicePool.wrap(spec, {"k": [t[:, 0] for t in kv], "v": [t[:, 1] for t in kv]})
    hs, ds = torch.arange(8, 24), torch.arange(0, 16)
    for force in (None, "copy"):
        plan = TransferPlan.build("load", host, dev, hs, ds, force=force)
        assert plan.path is TransferPath.REFERENCE
        assert plan.mechanisms_by_buffer() == {"k": {"reference": 16}, "v": {"reference": 16}}
    for layer in range(2):
        load_layer(plan, host, dev, layer)
    for layer in range(2):
        for i in range(16):
            assert same_bytes(kv[layer][int(ds[i]), 0], host_row(host, spec.buffer("k"), layer, int(hs[i])))
            assert same_bytes(kv[layer][int(ds[i]), 1], host_row(host, spec.buffer("v"), layer, int(hs[i])))

    wide = {name: [torch.zeros(48, 2, 8, dtype=torch.float32) for _ in range(2)] for name in ("k", "v")}
    dev32 = DevicePool.wrap(spec, wide)
    plan = TransferPlan.build("load", host, dev32, hs, ds)
    load_layer(plan, host, dev32, 0)
    want = torch.stack([host_row(host, spec.buffer("k"), 0, int(h)) for h in hs]).float()
    assert torch.equal(wide["k"][0][ds], want)


def test_no_device_value_is_read_back_during_fast_paths(monkeypatch, gen) -> None:
    """The per-layer loop of a copy or kernel plan never calls `.item()`, `.tolist()`, `torch.equal` or
    `bool()` on a tensor."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    cases = [
        ("copy", torch.arange(0, 64), torch.arange(64, 128)),
        ("copy", torch.cat([torch.arange(0, 32), torch.arange(96, 128)]), torch.arange(64)),
    ]
    if kernels.runs_on(torch.device("cpu")):
        cases.append(("kernel", torch.arange(0, 64), torch.randperm(256, generator=gen)[:64]))
    plans = [TransferPlan.build("load", host, dev, hs, ds, force=p) for p, hs, ds in cases]
    plans += [TransferPlan.build("backup", host, dev, hs, ds, force=p) for p, hs, ds in cases]

    def boom(*_a, **_k):
        raise AssertionError("a device value was read back inside the layer loop")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    monkeypatch.setattr(torch, "equal", boom)
    for plan in plans:
        if plan.direction is Direction.LOAD:
            for layer in range(spec.num_layers):
                load_layer(plan, host, dev, layer)
        else:
            backup(plan, dev, host)


@needs_triton
@pytest.mark.parametrize(("layout", "ps"), [("page_first", 1), ("page_first", 16), ("layer_first", 16)])
def test_the_kernel_moves_page_granular_runs_as_whole_pages(layout, ps, gen) -> None:
    """Runs of whole 16-slot pages: each kernel launch moves whole pages as units, never crossing a
    page in page_first (whose host runs break at every page)."""
    spec = preset("tiny-dsa", ps)
    host, dev = HostPool(spec, 512, layout), DevicePool(spec, 512)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
    ds = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
    plan = TransferPlan.build("load", host, dev, hs, ds, force="kernel", kernel=KernelOptions(2, 4))
    (part,) = plan.parts
    assert isinstance(part, KernelPart)
    unit = ps if layout == "page_first" else 16
    for b in spec.buffers:
        for launch_ in part.by_buffer[b.name].launches:
            assert launch_.n == len(hs) // unit
            shape = launch_.shape
            assert shape.row_vecs * shape.kwargs["VEC"] * shape.word == unit * b.row_bytes
    check_parts(plan)
    before = snapshot(host, dev)
    run_plan(plan, host, dev, grouped=True)
    check_moved(plan, host, dev, before)


@needs_triton
def test_load_layers_refuses_a_layer_outside_the_model_before_moving_any(gen) -> None:
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 64, "page_first"), DevicePool(spec, 64)
    poison_host(host, gen)
    before = dev.layer("kv", 0).clone()
    plan = TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), force="kernel")
    with pytest.raises(SpecError):
        load_layers(plan, host, dev, [0, 7])
    assert same_bytes(dev.layer("kv", 0), before)


def _glm5_pools(gen) -> tuple[HostPool, DevicePool]:
    """One layer of glm-5 (1152- and 132-byte rows) in poisoned pools of 4096 slots."""
    spec = preset("glm-5", 1).with_layers(1)
    host, dev = HostPool(spec, 4096, "layer_first"), DevicePool(spec, 4096)
    poison_host(host, gen)
    poison_device(dev, gen)
    return host, dev


def _launches(plan: TransferPlan) -> dict[int, list]:
    """Per row bytes of a buffer, the kernel launches the plan prepared for it."""
    (part,) = plan.parts
    assert isinstance(part, KernelPart)
    spec = plan.host_pool.spec
    return {spec.buffer(name).row_bytes: list(k.launches) for name, k in part.by_buffer.items()}


@needs_triton
@pytest.mark.parametrize("stages", [None, 1])
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_the_kernel_on_a_small_budget_loops_over_many_tiles_byte_identically(direction, stages, gen) -> None:
    """sm_budget 2: each program loops over many tiles; only loads of whole 128-byte lines (1152-byte
    rows) are pipelined, over the stages asked for."""
    host, dev = _glm5_pools(gen)
    hs, ds = torch.randperm(4096, generator=gen)[:1000], torch.randperm(4096, generator=gen)[:1000]
    opts = KernelOptions(sm_budget=2, stages=stages)
    plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel", kernel=opts)
    assert plan.sms_used <= 2
    stages_of = {}
    for row_bytes, launches in _launches(plan).items():
        (only,) = launches
        assert only.n > 2 * only.shape.rows  # more than one tile per program
        assert only.shape.grid(only.n) <= 2
        stages_of[row_bytes] = only.shape.kwargs["STAGES"]
    # Whole lines only where every base of the launch is line-aligned (CPU allocations may not be).
    ptrs = [*host.region_ptrs("kv").ravel().tolist(), *dev.layer_ptrs("kv").tolist()]
    lines = all(a % kernels.LINE_BYTES == 0 for a in ptrs)
    pipelined = (stages or kernels.MAX_STAGES) if direction == "load" and lines else 1
    assert stages_of == {1152: pipelined, 132: 1}
    before = snapshot(host, dev)
    run_plan(plan, host, dev)
    check_moved(plan, host, dev, before)


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_long_rows_take_fewer_programs_than_the_budget_unless_lean_is_off(direction, gen) -> None:
    """Lean launches: 1152-byte rows take fewer programs than the budget of 8, 132-byte rows all 8; with
    `lean=False` every launch takes the budget."""
    host, dev = _glm5_pools(gen)
    hs, ds = torch.randperm(4096, generator=gen)[:3000], torch.randperm(4096, generator=gen)[:3000]
    plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel")
    grids = {r: [x.shape.grid(x.n) for x in ls] for r, ls in _launches(plan).items()}
    assert grids[132] == [8] and 1 <= grids[1152][0] < 8
    assert plan.sms_used == 8
    full = TransferPlan.build(direction, host, dev, hs, ds, force="kernel", kernel=KernelOptions(lean=False))
    assert {r: [x.shape.grid(x.n) for x in ls] for r, ls in _launches(full).items()} == {1152: [8], 132: [8]}
    before = snapshot(host, dev)
    run_plan(plan, host, dev)
    check_moved(plan, host, dev, before)


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_long_rows_over_a_wide_host_span_take_more_programs(direction, gen, monkeypatch) -> None:
    """1152-byte single rows spread over more than `WIDE_SPAN_BYTES` (here 2 MiB) take more programs
    than the same rows within 1 MiB, or runs of 16 rows over the whole span; all byte for byte."""
    monkeypatch.setattr(kernels, "WIDE_SPAN_BYTES", 2 << 20)
    host, dev = _glm5_pools(gen)
    ds = torch.randperm(4096, generator=gen)[:800]
    spread, near = torch.randperm(4096, generator=gen)[:800], torch.randperm(800, generator=gen)
    runs = (torch.randperm(256, generator=gen)[:50, None] * 16 + torch.arange(16)).flatten()
    programs = {}
    for name, hs in (("spread", spread), ("near", near), ("runs", runs)):
        plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel")
        (only,) = _launches(plan)[1152]
        programs[name] = only.shape.grid(only.n)
        assert plan.sms_used <= 8
        before = snapshot(host, dev)
        run_plan(plan, host, dev)
        check_moved(plan, host, dev, before)
    assert programs["spread"] > programs["near"] and programs["spread"] > programs["runs"]


@needs_triton
@pytest.mark.parametrize(("ps", "word"), [(1, 4), (16, 8)])
def test_kernel_offsets_come_in_the_widest_words_the_rows_allow(ps, word, gen) -> None:
    """132-byte indexer rows: 4-byte words one by one (scattered slots), 8-byte words as 16-row pages."""
    spec = preset("tiny-dsa", ps)
    host, dev = HostPool(spec, 512), DevicePool(spec, 512)
    if ps == 1:
        hs, ds = torch.randperm(512, generator=gen)[:128], torch.randperm(512, generator=gen)[:128]
    else:
        hs = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
        ds = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
    plan = TransferPlan.build("load", host, dev, hs, ds, force="kernel")
    b = spec.buffer("indexer")
    for rows in _launches(plan)[b.row_bytes]:
        assert rows.shape.word == word
        unit_bytes = b.row_bytes * ps
        assert (rows.src_off.numpy() * word % unit_bytes == 0).all()  # whole units of the host region
        assert (rows.dst_off.numpy() * word % unit_bytes == 0).all()


@pytest.mark.parametrize("layout", list(HostLayout))
def test_copy_addresses_are_those_of_the_rows_the_tensor_path_copies(layout) -> None:
    """A copy part's byte table, turned into raw addresses as the batched path does, points at the
    rows that the per-run path's tensor views copy."""
    spec = preset("tiny-dsa", 4)
    host = HostPool(spec, 512, layout, chunk_bytes=4096)
    dev = DevicePool(spec, 512)
    hs = torch.cat([torch.arange(40, 120), torch.arange(300, 380)])
    ds = torch.cat([torch.arange(0, 80), torch.arange(200, 280)])
    plan = TransferPlan.build("load", host, dev, hs, ds, force="copy")
    (part,) = plan.parts
    seg = host.segment_slots
    triples = list(
        zip(part.runs.host.tolist(), part.runs.device.tolist(), part.runs.length.tolist(), strict=True)
    )
    assert sum(n for *_, n in triples) == len(hs)
    for b in spec.buffers:
        region, host_off, dev_off, nbytes = part.run_bytes[b.name]
        for j, layer in enumerate(b.layers):
            host_ptrs = host.region_ptrs(b.name)[j, region] + host_off
            dev_ptrs = dev.layer_ptrs(b.name)[j] + dev_off
            for r, (h, d, n) in enumerate(triples):
                assert host_ptrs[r] == host.segment(b.name, layer, h // seg)[h % seg].data_ptr()
                assert dev_ptrs[r] == dev.layer(b.name, layer)[d].data_ptr()
                assert nbytes[r] == n * b.row_bytes


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_whole_page_planning_finds_the_same_runs_as_per_slot(ps, layout) -> None:
    """Runs found from page heads equal those found slot by slot, segment edges included."""
    spec = preset("tiny-dsa", ps)
    host = HostPool(spec, 1024, layout, chunk_bytes=8192)  # several segments in layer_first
    dev = DevicePool(spec, 1024)
    rng = torch.Generator().manual_seed(ps)
    pages = 1024 // ps
    planner = Planner(host, dev, force="copy")
    for _ in range(5):
        hp = torch.randperm(pages, generator=rng)[: pages // 2].sort().values
        hp[: len(hp) // 3] = torch.arange(len(hp) // 3)  # some long runs across segment edges
        dp = torch.randperm(pages, generator=rng)[: len(hp)]
        hs = (hp[:, None] * ps + torch.arange(ps)).flatten()
        ds = (dp[:, None] * ps + torch.arange(ps)).flatten()
        a = planner.plan("load", hs, ds)
        b = planner.plan_allocated("load", hs, ds)
        assert (a.host_runs, a.device_runs, a.joint_runs) == (b.host_runs, b.device_runs, b.joint_runs)
        assert a.parts[0].runs.table.tolist() == b.parts[0].runs.table.tolist()


def _runs_table(part) -> list | None:
    return part.runs.table.tolist() if isinstance(part, CopyPart) else None


@pytest.mark.parametrize("layout", list(HostLayout))
def test_plans_from_run_lists_equal_plans_from_slots(layout) -> None:
    """A plan built from run lists is the slot-scan plan: same path, runs, rows and addresses."""
    spec = preset("tiny-mla", 2)
    host = HostPool(spec, 1024, layout, chunk_bytes=16384)
    dev = DevicePool(spec, 1024)
    gen = torch.Generator().manual_seed(3)
    cases = [(torch.arange(100, 300), torch.arange(500, 700))]  # crosses segment edges in layer_first
    for _ in range(6):
        hp = torch.randperm(512, generator=gen)[:64].sort().values
        hp[:30] = torch.arange(30)
        dp = torch.randperm(512, generator=gen)[:64]
        cases.append(
            ((hp[:, None] * 2 + torch.arange(2)).flatten(), (dp[:, None] * 2 + torch.arange(2)).flatten())
        )
    planners = [Planner(host, dev), Planner(host, dev, force="copy")]
    if kernels.runs_on(torch.device("cpu")):
        planners.append(Planner(host, dev, use_kernel=True))
    for hs, ds in cases:
        for planner in planners:
            a = planner.plan("load", hs, ds)
            b = planner.plan_allocated("load", hs, ds, runs=(_runs_of(hs), _runs_of(ds)))
            assert (a.path, a.host_runs, a.device_runs, a.joint_runs) == (
                b.path,
                b.host_runs,
                b.device_runs,
                b.joint_runs,
            )
            assert a.mechanisms_by_buffer() == b.mechanisms_by_buffer()
            assert [_runs_table(p) for p in a.parts] == [_runs_table(p) for p in b.parts]
            for p, q in zip(a.parts, b.parts, strict=True):
                if isinstance(p, CopyPart):
                    for name in p.run_bytes:
                        for x, y in zip(p.run_bytes[name], q.run_bytes[name], strict=True):
                            assert np.array_equal(x, y)
    with pytest.raises(PlanError, match="cover"):
        Planner(host, dev).plan_allocated("load", hs, ds, runs=([(0, 4)], [(0, 5)]))
    with pytest.raises(PlanError, match="the plan has"):
        Planner(host, dev).plan_allocated("load", hs, ds, runs=([(0, 4)], [(8, 4)]))


def test_batched_copies_fan_out_only_while_their_runs_are_short() -> None:
    """Runs averaging `fan_out_below_bytes` or more stay on one stream (no fork and join per layer);
    copies that are not batched (torch copies, on a CPU pool) never fan out."""
    spec = preset("tiny-mla", 1)  # 48-byte rows
    host, dev = HostPool(spec, 8192), DevicePool(spec, 8192)

    def streams(run: int, batched: bool = True, **kw) -> int:
        planner = Planner(host, dev, PathCosts(copy_streams=4, **kw), force="copy")
        planner.batched = batched  # as on CUDA with raw copies; the plan is only read, never run
        hs = _runs(list(range(0, 32, 2)), run)
        (part,) = planner.plan("load", hs, torch.arange(len(hs))).parts
        assert isinstance(part, CopyPart) and part.batched is batched and len(part.runs) == 16
        return part.streams

    assert streams(200) == 4  # 9.6 KB runs
    assert streams(200, fan_out_below_bytes=200 * 48) == 1
    assert streams(199, fan_out_below_bytes=200 * 48) == 4
    assert streams(8, batched=False) == 1


@pytest.mark.parametrize(
    ("costs", "field"),
    [
        (PathCosts(copy_streams=0), "copy_streams"),
        (PathCosts(copy_fixed_s=-1e-6), "fixed costs"),
        (PathCosts(launch_fixed_s=-1e-6), "fixed costs"),
        (PathCosts(split_s=-1e-6), "fixed costs"),
        (PathCosts(python_copy_s=-1e-6), "fixed costs"),
        (PathCosts(reference_gbps=0.0), "reference_gbps"),
        (PathCosts(kernel_share=()), "kernel_share"),
        (PathCosts(kernel_share=((256, 0.5), (128, 0.6))), "kernel_share"),
        (PathCosts(kernel_share=((128, 0.0),)), "kernel_share"),
        (PathCosts(kernel_share=((128, 1.5),)), "kernel_share"),
    ],
)
def test_path_costs_out_of_range_are_refused(costs, field) -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(ConfigError, match=field):
        TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), costs=costs)


def test_kernel_option_flags_must_be_booleans() -> None:
    """A flag given as a string ("no" would read as on) is refused before anything is planned."""
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(ConfigError, match=r"lean True or False, got .*lean='no'"):
        TransferPlan.build(
            "load", host, dev, torch.arange(8), torch.arange(8), kernel=KernelOptions(lean="no")
        )


@pytest.mark.parametrize(
    "bad",
    [
        {"sm_budget": 0},
        {"rows_per_program": 0},
        {"stages": 0},
        {"stages": -1},
        {"max_unit_bytes": 0},
        {"sm_budget": True},
    ],
)
def test_kernel_options_must_be_positive(bad: dict) -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(ConfigError, match="must be positive"):
        TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), kernel=KernelOptions(**bad))


def test_raw_runtime_is_absent_without_a_mapped_libcudart_and_errors_name_the_call() -> None:
    """On a machine without CUDA no `libcudart` is mapped: every raw path falls back (None)."""
    from kvtier.errors import CudaRuntimeError
    from kvtier.transfer import cudart

    if not torch.cuda.is_available():
        assert cudart.runtime() is None
    cudart.check(0, "cudaEventRecord")
    with pytest.raises(CudaRuntimeError, match="cudaEventRecord failed: CUDA error 400"):
        cudart.check(400, "cudaEventRecord")


def test_batches_start_at_two_copies_only_with_the_direct_batch_call(pin) -> None:
    """Where copies loop, plain copies up to 4; with the runtime's batch call, up to 1."""
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.BATCH, lambda *_a: None))
    assert cudart.small_batch() == 1
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
    assert cudart.small_batch() == 4
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP, small_batch=2))
    assert cudart.small_batch() == 2


def test_plans_refuse_pools_they_were_not_built_for(gen) -> None:
    """A plan records its pools: a load or backup handed other pools raises before anything moves."""
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    other_host, other_dev = HostPool(spec, 256), DevicePool(spec, 256)
    hs, ds = torch.arange(0, 64), torch.arange(64, 128)
    planner = Planner(host, dev, force="copy")
    load, back = planner.plan("load", hs, ds), planner.plan("backup", hs, ds)
    assert (load.host_pool, load.device_pool) == (host, dev)
    poison_host(other_host, gen)
    poison_device(other_dev, gen)
    before_dev, before_host = other_dev.layer("kv", 0).clone(), other_host.chunks("kv")[0].clone()
    with pytest.raises(PlanError, match="built for"):
        load_layer(load, other_host, dev, 0)
    with pytest.raises(PlanError, match="built for"):
        load_layers(load, host, other_dev, [0, 1])
    with pytest.raises(PlanError, match="built for"):
        backup(back, other_dev, host)
    with pytest.raises(PlanError, match="built for"):
        backup(back, dev, other_host)
    assert same_bytes(other_dev.layer("kv", 0), before_dev)
    assert same_bytes(other_host.chunks("kv")[0], before_host)


# -- every row moved by one part, for any slots and costs --------------------------------------------

_PROPERTY_POOLS: dict[tuple, tuple[HostPool, DevicePool]] = {}


def _property_pools(layout: str, ps: int) -> tuple[HostPool, DevicePool]:
    key = (layout, ps)
    if key not in _PROPERTY_POOLS:
        spec = preset("tiny-dsa", ps)
        _PROPERTY_POOLS[key] = HostPool(spec, 512, layout, chunk_bytes=4096), DevicePool(spec, 512)
    return _PROPERTY_POOLS[key]


@needs_triton
@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["layer_first", "page_first"]),
    ps=st.sampled_from([1, 4]),
    data=st.data(),
    force=st.sampled_from([None, "copy", "kernel", "reference"]),
    use_kernel=st.booleans(),
    copy_fixed=st.sampled_from([0.0, 1e-8, 1e-7, 1.5e-6]),
    copy_call=st.sampled_from([0.0, 1e-6, 10e-6]),
    launch_fixed=st.sampled_from([0.0, 6e-6, 1e-3]),
    min_bytes=st.sampled_from([0, 1024, 64 << 10]),
    direction=st.sampled_from(["load", "backup"]),
)
def test_every_row_of_every_buffer_is_moved_by_exactly_one_part(
    layout, ps, data, force, use_kernel, copy_fixed, copy_call, launch_fixed, min_bytes, direction
) -> None:
    """Whatever the slots and costs: each buffer's rows per mechanism sum to the plan's tokens, the
    parts' device rows are the plan's device slots exactly once each, the copy runs are whole joint
    runs and the kernel moves the rest of them (the plan is built, not run)."""
    host, dev = _property_pools(layout, ps)
    pages = data.draw(st.integers(1, 512 // ps // 2))
    order = data.draw(st.permutations(range(512 // ps)))
    k = data.draw(st.integers(0, pages))
    start = data.draw(st.integers(0, 512 // ps - k))
    stretch = list(range(start, start + k))  # ascending pages, as a contiguous allocator hands out
    host_pages = np.array(
        stretch + [q for q in order if not start <= q < start + k][: pages - k], dtype=np.int64
    )
    dev_pages = np.array(data.draw(st.permutations(range(512 // ps)))[: len(host_pages)], dtype=np.int64)
    hs = torch.from_numpy((host_pages[:, None] * ps + np.arange(ps)).reshape(-1))
    ds = torch.from_numpy((dev_pages[:, None] * ps + np.arange(ps)).reshape(-1))
    costs = PathCosts(
        copy_fixed_s=copy_fixed, copy_call_s=copy_call, launch_fixed_s=launch_fixed, copy_min_bytes=min_bytes
    )
    plan = Planner(host, dev, costs, force=force, use_kernel=use_kernel).plan(direction, hs, ds)
    if force is not None:
        assert plan.path is TransferPath(force)
    if not use_kernel and force != "kernel":
        assert plan.sms_used == 0
    check_parts(plan)


# -- Transfers.submit on a deferred CPU lane -----------------------------------------------------------


@pytest.mark.parametrize("force", [None, "copy", "kernel"])
@pytest.mark.parametrize("with_runs", [False, True])
def test_a_load_submitted_per_layer_lands_each_layer_only_once_its_signal_is_waited_for(
    force, with_runs, gen
) -> None:
    """One signal per model layer; nothing moves until a signal is waited for; waiting for layer i
    lands layers 0..i and no later one; every row then byte for byte."""
    if force == "kernel" and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    spec = preset("tiny-dsa", 2)
    host, dev = HostPool(spec, 128, chunk_bytes=2048), DevicePool(spec, 128)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = (torch.randperm(64, generator=gen)[:20, None] * 2 + torch.arange(2)).flatten()
    ds = (torch.randperm(64, generator=gen)[:20, None] * 2 + torch.arange(2)).flatten()
    parts = (hs[:16], hs[16:])
    op = Operation(
        Direction.LOAD,
        parts,
        ds,
        runs=(_runs_of(parts[0]) + _runs_of(parts[1]), _runs_of(ds)) if with_runs else None,
        whole_pages=True,
    )
    lane = DeferredLane()
    transfers = Transfers(host, dev, force=None if force is None else TransferPath(force))
    before = snapshot(host, dev)
    done = transfers.submit(op, lane, per_layer=True)
    assert len(done.signals) == spec.num_layers
    assert done.plan is not None and done.plan.num_tokens == 40
    if force is not None:
        assert done.plan.path is TransferPath(force)
    assert not done.done()
    assert all(same_bytes(v, snapshot(host, dev)[k]) for k, v in before.items())  # nothing moved yet

    def landed(layer: int) -> bool:
        return all(
            same_bytes(dev.layer(b.name, layer)[ds], before["host", b.name, layer][hs])
            for b in spec.buffers_on(layer)
        )

    for i, signal in enumerate(done.signals):
        signal.wait_host()
        assert all(landed(layer) for layer in range(i + 1))
        assert not any(landed(layer) for layer in range(i + 1, spec.num_layers))
    assert done.done()
    check_moved(done.plan, host, dev, before)


def test_a_backup_submitted_whole_has_one_signal_and_writes_the_host_only_when_waited_for(gen) -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = torch.arange(10, 30), torch.randperm(64, generator=gen)[:20]
    lane = DeferredLane()
    before = snapshot(host, dev)
    done = Transfers(host, dev).submit(Operation(Direction.BACKUP, (hs,), ds), lane, per_layer=False)
    assert len(done.signals) == 1 and not done.done()
    assert all(same_bytes(v, snapshot(host, dev)[k]) for k, v in before.items())
    done.wait()
    assert done.done()
    check_moved(done.plan, host, dev, before)


# -- CUDA --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_cuda_planner_paths_are_byte_identical(direction, gen) -> None:
    """On the GPU: copy, kernel and mixed plans (the planner's and forced) against the host rows, on a
    side stream; copies of short runs fanned out over streams. The planner's costs here leave out the
    fan-out's call cost and the split's, so long runs are copied and single rows are not."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 16384), DevicePool(spec, 16384, "cuda")
    stream = torch.cuda.Stream()
    costs = PathCosts(copy_call_s=0.0, split_s=0.0)
    long_runs = (torch.tensor([1, 5, 3])[:, None] * 2048 + torch.arange(2048)).flatten()
    short = 12288 + torch.randperm(4096, generator=gen)[:500]
    fanned = (torch.arange(0, 64, 2)[:, None] * 96 + torch.arange(96)).flatten()
    both = torch.cat([long_runs, short]), torch.cat([torch.arange(6144), 8000 + torch.arange(500)])
    cases = [
        (None, TransferPath.COPY, long_runs, torch.arange(6144)),
        (None, TransferPath.KERNEL, short, torch.randperm(16384, generator=gen)[:500]),
        (None, TransferPath.MIXED, *both),
        ("copy", TransferPath.COPY, fanned, torch.arange(3072)),
        ("kernel", TransferPath.KERNEL, long_runs, torch.arange(6144)),
        ("reference", TransferPath.REFERENCE, short, torch.randperm(16384, generator=gen)[:500]),
    ]
    for force, expected, hs, ds in cases:
        poison_host(host, gen)
        poison_device(dev, gen)
        plan = Planner(host, dev, costs, force=force).plan(direction, hs, ds, stream=stream)
        assert plan.path is expected, (force, plan.describe())
        if expected is TransferPath.MIXED:
            assert rows_by_mechanism(plan) == {"copy": 6144, "kernel": 500}
        check_parts(plan)
        for p in plan.parts:
            if isinstance(p, CopyPart):
                assert p.batched == (cudart.dma_mode() is not cudart.DmaMode.TORCH)
                if p.batched and hs is fanned:  # 32 runs of 4.6 KB: fanned out
                    assert p.streams == costs.copy_streams
        run_and_check(plan, host, dev, hs, ds, stream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_cuda_kernel_reads_every_region_of_a_chunked_host_pool(direction, layout, gen) -> None:
    """Pinned chunks of 64 KB: the kernel's one base per layer reaches every region (wherever the
    allocator put it), after first-fit churn and fully scattered, twice each on one stream."""
    from kvtier.bench.churn import after_churn

    spec = preset("glm-5").with_layers(3)
    host, dev = HostPool(spec, 8192, layout, chunk_bytes=64 << 10), DevicePool(spec, 8192, "cuda")
    assert len(host.chunks("kv")) > 8
    stream = torch.cuda.Stream()
    ds = torch.randperm(8192, generator=gen)[:3000]
    for hs in (torch.randperm(8192, generator=gen)[:3000], after_churn("first_fit", 3000, 8192, 1, 8, 0)):
        for force in ("kernel", None):
            plan = Planner(host, dev, force=force).plan(direction, hs, ds, stream=stream)
            check_parts(plan)
            for _ in range(2):
                poison_host(host, gen)
                poison_device(dev, gen)
                run_and_check(plan, host, dev, hs, ds, stream)
