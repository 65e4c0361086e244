"""The planner's split of mixed runs by buffer (small rows riding with the widest buffer's staging),
and the executor's overlap of such a plan's kernel and copy-engine parts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import poison_device, poison_host, run_and_check

from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import mha_spec, mla_spec
from kvtier.transfer import Planner, execute, kernels, phases, splits, staging
from kvtier.transfer import runs as slot_runs
from kvtier.transfer.costs import Choice
from kvtier.transfer.options import KernelOptions, PathCosts
from kvtier.transfer.parts import KernelPart, StagedPart

needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's interpreter"
)
# A GLM-5-shaped token on two layers: the 1152-byte latent row and the 132-byte indexer row.
SPEC = mla_spec("glm-5-shaped", 2, 512, 64, torch.bfloat16, indexer_layers=range(2))
# The thresholds with backups staged from 64 KiB too, so both directions plan alike.
COSTS = PathCosts(backup_staged_min_bytes=64 << 10)


def host_runs(lengths: list[int]) -> torch.Tensor:
    """Host slots: runs of `lengths` at distinct places 1024 slots apart."""
    return torch.cat([i * 1024 + torch.arange(n) for i, n in enumerate(lengths)])


def planned(
    direction: Direction,
    lengths: list[int],
    gen: torch.Generator,
    device: str = "cpu",
    kernel: KernelOptions | None = None,
    staging: int | None = None,
):
    host = HostPool(SPEC, max(8192, 1024 * len(lengths)), HostLayout.LAYER_FIRST)
    dev = DevicePool(SPEC, 8192, device, staging_tokens=staging)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = host_runs(lengths)
    ds = torch.randperm(8192, generator=gen)[: hs.numel()]
    plan = Planner(host, dev, COSTS, kernel, use_kernel=True).plan(direction, hs, ds)
    return plan, host, dev, hs, ds


@needs_triton
@pytest.mark.parametrize("direction", list(Direction))
def test_indexer_rows_ride_with_the_latents_staging_where_the_copies_stay_long(direction, gen) -> None:
    """Host runs of 128 and 16 rows onto scattered slots: the latent stages its runs of 128 rows by the
    copy engine (147 KB each); the indexer's same runs (17 KB, under its own 64 KiB) ride with them,
    the copies averaging 92 KB; its runs of 16 rows keep its own choice, staging by the kernel."""
    plan, host, dev, hs, ds = planned(direction, [128] * 4 + [16] * 4, gen)
    by = plan.mechanisms_by_buffer()
    assert by["kv"] == {"staged": 512, "kernel": 64}
    assert by["indexer"] == {"staged": 512, "staged_kernel": 64}
    # Both buffers stage the same host runs by the copy engine: one part of both, whose buffers lie
    # apart in the staging buffer.
    (by_copy,) = [p for p in plan.parts if p.mechanism.value == "staged" and p.kernel is None]
    assert by_copy.buffers == {"kv", "indexer"} and by_copy.runs.length.tolist() == [128] * 4
    assert by_copy.apart
    # A backup's copies of the indexer's runs (17 KB) would keep the copy engine waiting on the host
    # if they went first (`staging.pass_order`): the latent's go first in both directions.
    assert by_copy.order == ("kv", "indexer")
    run_and_check(plan, host, dev, hs, ds, None)


@needs_triton
@pytest.mark.parametrize("direction", list(Direction))
def test_indexer_rows_keep_their_own_choice_where_riding_would_make_the_copies_short(direction, gen) -> None:
    """Host runs of 64 rows: riding would make two copies of 41 KB a run on average, under the 64 KiB
    the host's issuing keeps up with, so the indexer's runs go through staging by the kernel."""
    plan, host, dev, hs, ds = planned(direction, [64] * 8, gen)
    assert plan.mechanisms_by_buffer() == {"kv": {"staged": 512}, "indexer": {"staged_kernel": 512}}
    run_and_check(plan, host, dev, hs, ds, None)


class Buf:
    def __init__(self, name: str, row_bytes: int, choice: Choice, layers: tuple[int, ...] = (0, 1)) -> None:
        self.name, self.row_bytes, self.choice, self.layers = name, row_bytes, choice, frozenset(layers)


def scan_of(lengths: list[int]) -> slot_runs.Scan:
    """The runs of host runs of `lengths` onto scattered device slots (every device slot its own run)."""
    hn = np.concatenate([i * 4096 + np.arange(n) for i, n in enumerate(lengths)]).astype(np.int64)
    dn = np.random.default_rng(0).permutation(1 << 16)[: len(hn)].astype(np.int64)
    host = HostPool(SPEC, 1 << 16, HostLayout.LAYER_FIRST)
    return slot_runs.scan(host, hn, dn, 1)


def same(a: splits.Split, b: splits.Split) -> bool:
    def key(s: splits.Split) -> list:
        return [None if v is None else (v[0].tolist(), v[1].tolist()) for v in s.values()]

    return key(a) == key(b)


def test_riding_needs_a_wider_buffer_and_keeps_every_row_once() -> None:
    wide = Buf("kv", 1152, Choice(64 << 10, 64 << 10, 0.0, "t"))
    small = Buf("indexer", 132, Choice(64 << 10, 64 << 10, 64 << 10, "t"))
    found = scan_of([200, 30, 200])
    n = 430
    assert same(splits.split_all([small], found, n, 64 << 10)["indexer"], small.choice.split(found, 132))
    both = splits.split_all([wide, small], found, n, 64 << 10)
    for name in ("kv", "indexer"):
        rows = sum(int(v[1].sum()) for v in both[name].values() if v is not None)
        assert rows == n
    # The indexer stages by the copy engine the two runs the latent stages; the run of 30 rows
    # (34 KB of latent rows) goes to the kernel for the latent, staging by the kernel for the indexer.
    assert both["indexer"]["staged"][1].tolist() == both["kv"]["staged"][1].tolist() == [200, 200]
    assert both["indexer"]["kernel_staged"][1].tolist() == [30]
    # A floor on the average copy no layer reaches: no riding.
    assert splits.split_all([wide, small], found, n, 1 << 30)["indexer"]["staged"] is None
    # Nor on a layer the latent is not on, where the indexer's short copies would go alone.
    apart = Buf("indexer", 132, small.choice, (1, 2))
    assert same(
        splits.split_all([wide, apart], found, n, 64 << 10)["indexer"], small.choice.split(found, 132)
    )
    wider = Buf("kv", 1152, wide.choice, (0, 1, 2))
    assert same(splits.split_all([wider, apart], found, n, 64 << 10)["indexer"], both["indexer"])


def test_buffers_that_split_alike_share_one_entry() -> None:
    found = scan_of([100, 100])
    c = Choice(64 << 10, 1 << 10, 0.0, "t")
    got = splits.by_buffer(splits.split_all([Buf("k", 512, c), Buf("v", 512, c)], found, 200, 0))
    assert [names for names, _ in got] == [frozenset({"k", "v"})]


def split_of(
    direction: Direction, lengths: list[int], kernel: KernelOptions | None = None, staging: int | None = None
):
    plan = planned(direction, lengths, torch.Generator().manual_seed(0), kernel=kernel, staging=staging)[0]
    got = plan.overlap
    named = None if got is None else [[(type(p).__name__, *sorted(p.buffers)) for p in ps] for ps in got]
    return plan, got, named


@needs_triton
@pytest.mark.parametrize("direction", list(Direction))
def test_a_mixed_plan_runs_its_direct_kernel_parts_beside_the_rest(direction, gen) -> None:
    """Each part once, in plan order per stream; the kernel's units beside the direct kernel part
    where the two grids fit the budget together (2 + 4 programs of 8 here), else on the second stream
    before it where their staging place lies apart from the copy engine's, else before the fork."""
    plan, got, named = split_of(direction, [128] * 4 + [16] * 4)
    assert named == [
        [],
        [("KernelPart", "kv")],
        [("StagedPart", "indexer", "kv"), ("StagedPart", "indexer")],  # the runs both stage, then units
    ]
    assert sorted(map(id, got.before + got.side + got.beside)) == sorted(map(id, plan.parts))
    side, units = phases.programs(got.side[0]), phases.programs(got.beside[1])
    assert plan.sms_used == side + units <= plan.kernel.sm_budget
    assert not execute.overlaps(plan)  # on the CPU every part runs in plan order, on no stream
    # A budget of 5: the units on the second stream before the direct kernel, their staging place
    # after the copy engine's staged part's, and the plan holds 4 SMs at most.
    plan, got, named = split_of(direction, [128] * 4 + [16] * 4, KernelOptions(sm_budget=5))
    assert named == [[], [("StagedPart", "indexer"), ("KernelPart", "kv")], [("StagedPart", "indexer", "kv")]]
    units, engine = got.side[0], got.beside[0]
    rb = {b.name: b.row_bytes for b in SPEC.buffers}
    assert staging.footprint(engine, rb)[1] <= staging.footprint(units, rb)[0]
    assert staging.footprint(units, rb)[1] <= plan.device_pool.staging(direction).numel()
    assert units.window_rows == 64 and units.stage_at["indexer"] % staging.STAGE_ALIGN == 0
    assert plan.sms_used == max(map(phases.programs, plan.parts)) <= 5
    # A staging buffer the staged part fills (500 rows: windows of 448 apart, 575232 of its 576000 bytes),
    # no place apart, so the units go before the fork.
    plan, got, named = split_of(direction, [128] * 4 + [16] * 4, KernelOptions(sm_budget=5), staging=500)
    assert named[0] == [("StagedPart", "indexer")] and named[1] == [("KernelPart", "kv")]
    assert got.before[0].stage_at == {"indexer": 0}
    # Without the overlap the units' part stays at the start of the staging buffer.
    plan = split_of(direction, [128] * 4 + [16] * 4, KernelOptions(sm_budget=5, overlap=False))[0]
    assert [p.stage_at for p in plan.parts if isinstance(p, StagedPart) and p.kernel] == [{"indexer": 0}]
    # The plan with the units' place moved, its parts in plan order (the CPU), byte for byte.
    plan, host, dev, hs, ds = planned(direction, [128] * 4 + [16] * 4, gen, kernel=KernelOptions(sm_budget=5))
    assert plan.overlap.side[0].stage_at["indexer"] > 0
    run_and_check(plan, host, dev, hs, ds, None)
    # Runs of 16 alone: the latent's kernel beside the indexer's units; a backup stages a share of the
    # latent's runs by the copy engine beside them too (`splits.shared`).
    share = [("StagedPart", "kv")] if direction is Direction.BACKUP else []
    assert split_of(direction, [16] * 8)[2] == [
        [],
        [("KernelPart", "kv")],
        [*share, ("StagedPart", "indexer")],
    ]


def test_a_share_of_the_kernels_pieces_goes_to_the_copy_engine() -> None:
    """`splits.shared`: every `1/share`-th host run of `min_bytes` or more, evenly spread, to the copy
    engine (a joint run copied, single rows over scattered slots staged), every row once; nothing moves
    where the split has copy-engine runs already, or no piece is long enough."""
    # 10 host runs of 16 rows onto contiguous device slots (joint runs), then 10 onto scattered ones.
    hs = host_runs([16] * 20).numpy()
    ds = np.concatenate([np.arange(160), 1000 + 7 * np.arange(160)])
    found = slot_runs.scan(HostPool(SPEC, 1 << 15, HostLayout.LAYER_FIRST), hs, ds, 1)
    kernel = {"copy": None, "staged": None, "kernel_staged": None, "kernel": found.joint}
    got = splits.shared(kernel, found, 1152, 0.3, 16 << 10)
    assert got["copy"][0].tolist() == [48, 96, 144] and got["copy"][1].tolist() == [16] * 3
    assert got["staged"][0].tolist() == [208, 256, 304] and got["staged"][1].tolist() == [16] * 3
    seen = np.zeros(320, dtype=int)
    for starts, lens in (got["copy"], got["staged"], got["kernel"]):
        for a, n in zip(starts.tolist(), lens.tolist(), strict=True):
            seen[a : a + n] += 1
    assert (seen == 1).all()
    assert splits.shared(kernel, found, 132, 0.3, 16 << 10) is kernel  # 2 KB pieces: none long enough
    mixed = kernel | {"copy": found.joint}
    assert splits.shared(mixed, found, 1152, 0.3, 16 << 10) is mixed


@needs_triton
@pytest.mark.parametrize("device_slots", ["contiguous", "scattered"])
def test_an_overlapped_backup_moves_a_share_of_its_kernel_runs_on_the_copy_engine(device_slots, gen) -> None:
    """`PathCosts.copy_share`: runs of 16 latent rows (18 KB) that the kernel moves alone; a backup
    hands 0.3 of them to the copy engine (copied onto contiguous device slots, staged from scattered
    ones), byte for byte; a load, a backup without overlap or with a share of 0, none."""
    host = HostPool(SPEC, 1 << 15, HostLayout.LAYER_FIRST)
    dev = DevicePool(SPEC, 8192)
    hs = host_runs([16] * 20)
    ds = torch.arange(100, 420) if device_slots == "contiguous" else torch.randperm(8192, generator=gen)[:320]
    by = "copy" if device_slots == "contiguous" else "staged"
    plan = Planner(host, dev, COSTS, use_kernel=True).plan(Direction.BACKUP, hs, ds)
    assert plan.mechanisms_by_buffer()["kv"] == {by: 6 * 16, "kernel": 14 * 16}
    poison_host(host, gen)
    poison_device(dev, gen)
    run_and_check(plan, host, dev, hs, ds, None)
    for direction, costs, kernel in (
        (Direction.LOAD, COSTS, None),
        (Direction.BACKUP, COSTS, KernelOptions(overlap=False)),
        (Direction.BACKUP, dataclasses.replace(COSTS, backup_copy_share=0.0), None),
    ):
        plan = Planner(host, dev, costs, kernel, use_kernel=True).plan(direction, hs, ds)
        assert plan.mechanisms_by_buffer()["kv"] == {"kernel": 320}


@needs_triton
def test_plans_without_a_direct_kernel_part_or_overlap_run_in_order() -> None:
    assert split_of(Direction.LOAD, [64] * 8)[1] is None  # staging only
    assert split_of(Direction.LOAD, [128] * 4 + [16] * 4, KernelOptions(overlap=False))[1] is None


@needs_triton
def test_a_load_of_kernel_parts_alone_runs_by_buffer_on_the_programs_left(gen) -> None:
    """Fully scattered rows: the latent's launches on the second stream as planned, the indexer's beside
    them relaunched on what the latent leaves of the budget, every unit once and byte for byte;
    backups in plan order."""
    plan, got, named = split_of(Direction.LOAD, [1] * 48)
    assert plan.mechanisms_by_buffer() == {"kv": {"kernel": 48}, "indexer": {"kernel": 48}}
    assert named == [[], [("KernelPart", "kv")], [("KernelPart", "indexer")]]
    (part,) = plan.parts
    lead, rest = got.side[0], got.beside[0]
    assert lead.regions["kv"] == part.regions["kv"]
    narrowed = [r.launch.programs for r in rest.regions["indexer"]]
    assert max(narrowed) == plan.kernel.sm_budget - lead.programs < part.programs
    assert [(r.region, r.src, r.dst) for r in rest.regions["indexer"]] == [
        (r.region, r.src, r.dst) for r in part.regions["indexer"]
    ]
    assert plan.sms_used == lead.programs + rest.programs <= plan.kernel.sm_budget
    # The split's parts in turn (on the CPU, no streams) move exactly what the plan moves.
    plan, host, dev, hs, ds = planned(Direction.LOAD, [1] * 48, gen)
    split = plan.overlap
    run_and_check(dataclasses.replace(plan, parts=split.side + split.beside), host, dev, hs, ds, None)
    assert split_of(Direction.BACKUP, [1] * 48)[1] is None
    assert split_of(Direction.LOAD, [1] * 48, KernelOptions(overlap=False))[1] is None
    # K and V rows of 2048 bytes: equal launches, on the few programs the planner gave them, in turn.
    spec = mha_spec("llama-shaped", 2, 8, 128)
    host, dev = HostPool(spec, 8192, HostLayout.LAYER_FIRST), DevicePool(spec, 8192, "cpu")
    plan = Planner(host, dev, COSTS, use_kernel=True).plan(
        Direction.LOAD, host_runs([1] * 8), torch.arange(8)
    )
    assert isinstance(plan.parts[0], KernelPart) and plan.overlap is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lengths", [[128] * 4 + [16] * 4 + [1] * 40, [16] * 8], ids=["mixed", "runs-16"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("direction", list(Direction))
def test_cuda_overlapped_plans_are_byte_identical(direction, overlap, lengths, gen) -> None:
    """On the GPU, GLM-5-shaped plans over a side stream, their kernel parts beside the rest or not:
    staging by the copy engine (in windows) and by the kernel's units, and direct kernel rows."""
    kernel = KernelOptions(overlap=overlap)
    plan, host, dev, hs, ds = planned(direction, lengths, gen, "cuda", kernel, 300)
    assert execute.overlaps(plan) is overlap
    _twice(plan, host, dev, hs, ds, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", list(Direction))
def test_cuda_units_on_the_second_stream_are_byte_identical(direction, gen) -> None:
    """On the GPU, a mixed GLM-5-shaped plan at a budget of 5: the kernel's units on the second stream
    before the direct kernel, in their own place of the staging buffer, beside the copies."""
    plan, host, dev, hs, ds = planned(
        direction, [128] * 4 + [16] * 4 + [1] * 40, gen, "cuda", KernelOptions(sm_budget=5)
    )
    assert execute.overlaps(plan) and isinstance(plan.overlap.side[0], StagedPart)
    _twice(plan, host, dev, hs, ds, gen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device_slots", ["contiguous", "scattered"])
def test_cuda_a_backups_copy_share_beside_the_kernel_is_byte_identical(device_slots, gen) -> None:
    """On the GPU, a GLM-5-shaped backup of runs of 16 rows: a share of the latent's runs on the copy
    engine (copied, or staged from scattered device slots) beside its kernel and the indexer's units."""
    host = HostPool(SPEC, 1 << 15, HostLayout.LAYER_FIRST)
    dev = DevicePool(SPEC, 8192, "cuda")
    hs = host_runs([16] * 20)
    ds = torch.arange(100, 420) if device_slots == "contiguous" else torch.randperm(8192, generator=gen)[:320]
    plan = Planner(host, dev, COSTS, use_kernel=True).plan(Direction.BACKUP, hs, ds)
    assert execute.overlaps(plan) and plan.mechanisms_by_buffer()["kv"]["kernel"] == 14 * 16
    _twice(plan, host, dev, hs, ds, gen)


def _twice(plan, host, dev, hs, ds, gen) -> None:
    """`plan` twice on one stream (the second time on the streams the first made), poisoned first."""
    stream = torch.cuda.Stream()
    for _ in range(2):
        poison_host(host, gen)
        poison_device(dev, gen)
        run_and_check(plan, host, dev, hs, ds, stream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loads_by_buffer_are_byte_identical(gen) -> None:
    """On the GPU, a fully scattered GLM-5-shaped load: the latent on the side stream, the indexer on
    the caller's on the programs left."""
    plan, host, dev, hs, ds = planned(Direction.LOAD, [1] * 200, gen, "cuda")
    assert execute.overlaps(plan) and [p.buffers for p in plan.overlap.beside] == [{"indexer"}]
    _twice(plan, host, dev, hs, ds, gen)


def test_a_staged_parts_buffers_lie_apart_in_the_staging_buffer(gen) -> None:
    """`staging_layout`: each buffer of a part its own aligned place, disjoint and inside the staging
    buffer, for as many rows as fit them all; one buffer, or too little room, from the start. A part
    over both buffers lies apart and moves every row, window by window, in both directions; without
    the overlap, one after the other."""
    from kvtier.spec import preset

    spec = preset("glm-5").with_layers(2)
    dev = DevicePool(spec, 4096, staging_tokens=1000)
    latent, indexer = spec.buffers
    assert staging.staging_layout(dev, [latent]) == (1000, {latent.name: 0})
    rows, at = staging.staging_layout(dev, [latent, indexer])
    assert (1000 * 1152 - 128) // 1284 == 897 and rows == 896  # a multiple of `staging.WINDOW_ROWS`
    assert at[latent.name] == 0 and at[indexer.name] % staging.STAGE_ALIGN == 0
    assert (
        rows * 1152 <= at[indexer.name]
        and at[indexer.name] + rows * 132 <= dev.staging(Direction.LOAD).numel()
    )
    small = DevicePool(mha_spec("kv", 2, 1, 64), 64, staging_tokens=1)
    b = small.spec.buffers
    assert staging.staging_layout(small, list(b)) == (
        1,
        {x.name: 0 for x in b},
    )  # no room: one after the other
    host = HostPool(spec, 4096)
    hs, ds = torch.arange(100, 2100), torch.randperm(4096, generator=gen)[:2000]
    for direction in ("load", "backup"):
        plan = Planner(host, dev, PathCosts(staged_min_bytes=1, backup_staged_min_bytes=1)).plan(
            direction, hs, ds
        )
        (part,) = plan.parts
        assert part.apart and len(part.windows) == 3  # 2000 rows in windows of 896
        # A backup's indexer goes first, its gather short, its copy of the first window 118 KB long.
        small_first = direction == "backup"
        assert part.order == ((indexer.name, latent.name) if small_first else (latent.name, indexer.name))
        poison_host(host, gen)
        poison_device(dev, gen)
        run_and_check(plan, host, dev, hs, ds, None)
    costs = PathCosts(staged_min_bytes=1, backup_staged_min_bytes=1)
    (part,) = Planner(host, dev, costs, kernel=KernelOptions(overlap=False)).plan("backup", hs, ds).parts
    assert not part.apart and len(part.windows) == 2  # windows of the 1000 rows the staging holds
    # Over 16 host runs (2 per copy stream) a backup's buffers lie one after the other, a load's apart.
    many = (torch.arange(16)[:, None] * 200 + torch.arange(120)).flatten()
    for direction in ("load", "backup"):
        plan = Planner(host, dev, costs).plan(direction, many, ds[: len(many)])
        (part,) = plan.parts
        assert len(part.runs.length) >= 16 and part.apart == (direction == "load")
        poison_host(host, gen)
        poison_device(dev, gen)
        run_and_check(plan, host, dev, many, ds[: len(many)], None)


@needs_triton
def test_windows_apart_keep_runs_of_64_whole_units_of_the_kernel(gen) -> None:
    """Windows of buffers apart hold a multiple of `staging.WINDOW_ROWS` rows, so runs of 64 cut at
    windows stay units of 64 rows (windows of the 72 rows that fit would cut them into units of 8):
    a backup's host runs through staging by the kernel's units, byte for byte."""
    from kvtier.spec import preset

    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 2048, HostLayout.LAYER_FIRST), DevicePool(spec, 2048, staging_tokens=100)
    hs = (torch.tensor([1, 4, 9, 13])[:, None] * 64 + torch.arange(64)).flatten()
    ds = torch.randperm(2048, generator=gen)[: hs.numel()]
    costs = PathCosts(copy_min_bytes=100 * 48, staged_min_bytes=100 * 132)
    plan = Planner(host, dev, costs, use_kernel=True).plan("backup", hs, ds)
    (part,) = plan.parts
    assert isinstance(part, StagedPart) and part.kernel is not None and part.apart
    assert part.window_rows == 64 and part.unit == 64 and len(part.windows) == 4
    poison_host(host, gen)
    poison_device(dev, gen)
    run_and_check(plan, host, dev, hs, ds, None)


def test_a_backups_buffers_go_smallest_first_where_its_copies_are_long_or_by_the_kernel() -> None:
    """`pass_order`: spec order for loads (None) and one buffer; for backups the smallest rows first
    where the kernel's units move them or their first window's copies average 64 KiB or more."""
    from kvtier.spec import preset
    from kvtier.transfer.parts import RunBytes, Window

    latent, indexer = preset("glm-5").with_layers(1).buffers
    windows = (Window(0, 600, 0, 2), Window(600, 700, 2, 3))

    def in_bytes(first_two: int) -> dict[str, RunBytes]:
        sizes = np.array([first_two, first_two, 1 << 30], dtype=np.int64)
        zero = np.zeros(3, dtype=np.int64)
        return {b.name: RunBytes(zero, zero, zero, sizes) for b in (latent, indexer)}

    both, spec_order = [latent, indexer], (latent.name, indexer.name)
    assert staging.pass_order(both, in_bytes(1 << 20), windows, False, None) == spec_order
    assert staging.pass_order([latent], in_bytes(1 << 20), windows, False, 65536) == (latent.name,)
    assert staging.pass_order(both, in_bytes(65536), windows, False, 65536) == (indexer.name, latent.name)
    # The third run's size lies in the second window: the first window's average decides.
    assert staging.pass_order(both, in_bytes(65535), windows, False, 65536) == spec_order
    assert staging.pass_order(both, in_bytes(100), windows, True, 65536) == (indexer.name, latent.name)
