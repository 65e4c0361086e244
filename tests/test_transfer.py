"""Every transfer path against a per-token reference, byte for byte, with poisoned destinations."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch
from conftest import host_row, host_rows, poison_device, poison_host, random_rows, run_and_check, same_bytes

from kvtier.errors import ConfigError, PlanError, SlotError, SpecError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import (
    KernelOptions,
    PathCosts,
    Planner,
    TransferPath,
    TransferPlan,
    backup,
    dma,
    groups,
    kernels,
    launch,
    load_layer,
    load_layers,
)
from kvtier.transfer.options import Mechanism
from kvtier.transfer.parts import CopyPart, StagedPart, copy_streams

SPECS = ["tiny-mha", "tiny-mha-fp16", "tiny-mla", "tiny-mla-fp8", "tiny-dsa"]
PAGE_SIZES = [1, 16, 64]
HOST_SLOTS = 256
DEVICE_SLOTS = 192
TOKENS = 128
FREE_COPIES = PathCosts(copy_issue_s=0.0)


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


# Every value of each factor of the byte-identity test; each pair of values of two factors
# appears in at least one case (`pairwise`), instead of the full product. `None`: the planner's
# own path.
FACTORS: dict[str, list] = {
    "spec": SPECS,
    "ps": PAGE_SIZES,
    "layout": list(HostLayout),
    "path": [
        None,
        TransferPath.SINGLE_COPY,
        TransferPath.PER_RUN,
        TransferPath.STAGED,
        TransferPath.KERNEL,
        TransferPath.REFERENCE,
    ],
    "direction": ["load", "backup"],
    "case": [
        "one-run",
        "host-run-device-scattered",
        "runs-of-16",
        "runs-of-16-device-scattered",
        "scattered",
    ],
}


def applies(values: dict) -> bool:
    """Whether a (partial) case can run: a single copy needs one joint run, which only the one-run
    slots have, and only in `layer_first` (`page_first` cuts runs at every page)."""
    if values.get("path") is not TransferPath.SINGLE_COPY:
        return True
    return values.get("case", "one-run") == "one-run" and values.get("layout", HostLayout.LAYER_FIRST) is (
        HostLayout.LAYER_FIRST
    )


def required_pairs(factors: dict[str, list]) -> set[tuple]:
    names = list(factors)
    return {
        ((a, repr(va)), (b, repr(vb)))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        for va in factors[a]
        for vb in factors[b]
        if applies({a: va, b: vb})
    }


def pairs_of(row: dict) -> set[tuple]:
    names = list(row)
    return {((a, repr(row[a])), (b, repr(row[b]))) for i, a in enumerate(names) for b in names[i + 1 :]}


def pairwise(factors: dict[str, list]) -> list[dict]:
    """Cases covering every applicable pair of values of two factors (greedy, deterministic).

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
                options = [v for v in factors[name] if applies({**row, name: v})]
                row[name] = max(
                    options, key=lambda v: (len(pairs_of({**row, name: v}) & uncovered), -used[name, repr(v)])
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
    assert all(applies(c) for c in CASES)
    assert len(CASES) < 60  # far fewer than the product of the factors


def _case_id(c: dict) -> str:
    path = c["path"].value if c["path"] is not None else "planned"
    return f"{c['spec']}-{c['ps']}-{c['layout'].value}-{path}-{c['direction']}-{c['case']}"


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_every_path_matches_the_reference(c: dict, gen) -> None:
    """A load or backup on every path is byte-identical to the layout's own rows; no other row of
    the poisoned destination changes."""
    if c["path"] is TransferPath.KERNEL and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    spec = preset(c["spec"], c["ps"])
    host = HostPool(spec, HOST_SLOTS, c["layout"])
    dev = DevicePool(spec, DEVICE_SLOTS, staging_tokens=48)  # staging smaller than the load: windows
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = slot_case(c["case"], c["ps"], gen)
    plan = TransferPlan.build(c["direction"], host, dev, hs, ds, force=c["path"])
    if c["path"] is not None:
        assert plan.path is c["path"]
    before_dev = {(b.name, lay): dev.layer(b.name, lay).clone() for b in spec.buffers for lay in b.layers}
    before_host = {
        (b.name, lay): host_rows(host, b, lay, torch.arange(HOST_SLOTS))
        for b in spec.buffers
        for lay in b.layers
    }
    if c["direction"] == "load":
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer)
    else:
        backup(plan, dev, host)
    for b in spec.buffers:
        for layer in b.layers:
            got_dev, got_host = dev.layer(b.name, layer), host_rows(host, b, layer, torch.arange(HOST_SLOTS))
            if c["direction"] == "load":
                want = before_dev[(b.name, layer)].clone()
                want[ds] = before_host[(b.name, layer)][hs]
                assert same_bytes(got_dev, want), (b.name, layer)
            else:
                want = before_host[(b.name, layer)].clone()
                want[hs] = before_dev[(b.name, layer)][ds]
                assert same_bytes(got_host, want), (b.name, layer)


def test_multi_chunk_host_pool_round_trip(gen) -> None:
    """Chunks of a few KiB force runs to split at segment boundaries; data survives both ways."""
    spec = preset("tiny-dsa", 4)
    for layout in HostLayout:
        host = HostPool(spec, 512, layout, chunk_bytes=4096)
        assert len(host.chunks("kv")) > 1
        assert all(c.nbytes <= 4096 for c in host.chunks("kv"))
        dev = DevicePool(spec, 512)
        truth = {(b.name, lay): random_rows(512, b, gen) for b in spec.buffers for lay in b.layers}
        for (name, lay), rows in truth.items():
            dev.layer(name, lay).copy_(rows)
        hs = torch.arange(512)
        plan = TransferPlan.build("backup", host, dev, hs, torch.arange(512), costs=FREE_COPIES)
        assert plan.path is not TransferPath.REFERENCE
        backup(plan, dev, host)
        poison_device(dev, gen)
        perm = torch.randperm(512, generator=gen)
        plan = TransferPlan.build("load", host, dev, hs, perm, costs=FREE_COPIES)
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer)
        for (name, lay), rows in truth.items():
            assert same_bytes(dev.layer(name, lay)[perm], rows), (layout, name, lay)


def test_planner_picks_the_cheapest_path(gen) -> None:
    spec = preset("tiny-mla", 1)
    host = HostPool(spec, 4096)
    dev = DevicePool(spec, 4096)
    # Rows of 48 B: a copy costs 10 us to issue, the reference path moves 0.1 GB/s.
    costs = PathCosts(copy_issue_s=10e-6, copy_gbps=50.0, device_gbps=1000.0, reference_gbps=0.1)

    def path(hs, ds) -> TransferPath:
        return TransferPlan.build("load", host, dev, hs, ds, costs=costs).path

    def runs(starts, length):
        return (torch.tensor(starts)[:, None] * length + torch.arange(length)).flatten()

    scattered = torch.randperm(4096, generator=gen)
    assert path(torch.arange(100, 400), torch.arange(0, 300)) is TransferPath.SINGLE_COPY
    assert path(torch.arange(100, 400), scattered[:300]) is TransferPath.STAGED
    long_runs = runs([7, 2, 11, 4], 256)
    assert path(long_runs, torch.arange(1024)) is TransferPath.PER_RUN
    assert path(long_runs, scattered[:1024]) is TransferPath.STAGED
    single_rows = runs(list(range(0, 4096, 2)), 1)
    assert path(single_rows, torch.arange(2048)) is TransferPath.REFERENCE
    # Many short runs on both sides: per-run issue cost exceeds the reference path's.
    assert path(runs(list(range(0, 256, 2)), 16), torch.arange(2048)) is TransferPath.REFERENCE
    empty = torch.tensor([], dtype=torch.int64)
    assert path(empty, empty) is TransferPath.SINGLE_COPY


def test_plan_counts_runs() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    plan = TransferPlan.build("load", host, dev, [0, 1, 2, 10, 11, 30], [5, 6, 9, 10, 11, 12])
    assert (plan.host_runs, plan.device_runs, plan.joint_runs) == (3, 2, 4)


@pytest.mark.parametrize(
    ("hs", "ds", "message"),
    [
        ([0, 1, 64], [0, 1, 2], "outside"),
        ([0, 1, 2], [0, 1, -1], "outside"),
        ([0, 1, 2], [0, 1], "entries"),
        ([0, 1, 2], [3, 3, 4], "repeats"),
    ],
)
def test_bad_slots_raise_before_anything_is_written(hs, ds, message, gen) -> None:
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    poison_device(dev, gen)
    before = dev.layer("kv", 0).clone()
    with pytest.raises(SlotError, match=message):
        TransferPlan.build("load", host, dev, hs, ds)
    assert same_bytes(dev.layer("kv", 0), before)


def test_backup_rejects_repeated_host_slots_but_load_allows_repeated_sources() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(SlotError, match="host_slots"):
        TransferPlan.build("backup", host, dev, [1, 1], [2, 3])
    TransferPlan.build("load", host, dev, [1, 1], [2, 3])  # one host row to two device slots is fine


def test_bad_index_tensors_raise() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(SlotError, match="integer"):
        TransferPlan.build("load", host, dev, torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(SlotError, match="1-D"):
        TransferPlan.build("load", host, dev, torch.tensor([[1]]), torch.tensor([1]))
    with pytest.raises(PlanError, match="single copy"):
        TransferPlan.build("load", host, dev, [1, 5], [1, 2], force="single_copy")
    plan = TransferPlan.build("load", host, dev, [1], [1])
    with pytest.raises(ValueError, match="plan is for load"):
        backup(plan, dev, host)


def test_mismatched_specs_are_refused() -> None:
    host = HostPool(preset("tiny-mla"), 64)
    dev = DevicePool(preset("tiny-mha"), 64)
    with pytest.raises(PlanError, match="different buffers"):
        TransferPlan.build("load", host, dev, [1], [1])


def test_wrapped_engine_tensors_fall_back_to_reference(gen) -> None:
    """Rows not packed (a `[slots, 2, heads, dim]` KV tensor) or another dtype: still exact."""
    spec = preset("tiny-mha", 1)
    host = HostPool(spec, 64)
    poison_host(host, gen)
    kv = [torch.zeros(48, 2, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    dev = DevicePool.wrap(spec, {"k": [t[:, 0] for t in kv], "v": [t[:, 1] for t in kv]})
    hs, ds = torch.arange(8, 24), torch.arange(0, 16)
    plan = TransferPlan.build("load", host, dev, hs, ds)
    assert plan.path is TransferPath.SINGLE_COPY
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
    """The per-layer loop of a fast path never calls `.item()`, `.tolist()`, `torch.equal` or `bool()`."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    cases = {
        TransferPath.SINGLE_COPY: (torch.arange(0, 64), torch.arange(64, 128)),
        TransferPath.STAGED: (torch.arange(0, 64), torch.randperm(256, generator=gen)[:64]),
        TransferPath.PER_RUN: (
            torch.cat([torch.arange(0, 32), torch.arange(96, 128)]),
            torch.arange(64),
        ),
    }
    plans = [TransferPlan.build("load", host, dev, hs, ds, force=p) for p, (hs, ds) in cases.items()]

    def boom(*_a, **_k):
        raise AssertionError("a device value was read back inside the layer loop")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    monkeypatch.setattr(torch, "equal", boom)
    for plan in plans:
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer)


needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's CPU interpreter"
)


def _pf_rows(slots: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Rows of every layer of `slots` in a page-first chunk (page size 1) flattened to `[slots * L, *row]`."""
    return (slots[:, None] * n_layers + torch.arange(n_layers)).flatten()


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_mixed_plan_sends_long_runs_to_the_copy_engine_and_the_rest_to_the_kernel(direction, layout, gen):
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 1024, layout), DevicePool(spec, 1024)
    poison_host(host, gen)
    poison_device(dev, gen)
    short_host = torch.randperm(512, generator=gen)[:100]
    short_dev = torch.randperm(512, generator=gen)[:100] + 512
    hs = torch.cat([short_host[:50], torch.arange(512, 812), short_host[50:]])
    ds = torch.cat([short_dev[:50], torch.arange(0, 300), short_dev[50:]])
    # runs of 200 rows of the narrowest buffer (each buffer's runs are measured in its own rows): copy engine
    costs = PathCosts(copy_min_bytes=200 * 48)
    plan = Planner(host, dev, costs, use_kernel=True).plan(direction, hs, ds)
    if layout is HostLayout.LAYER_FIRST:
        assert plan.path is TransferPath.MIXED
        assert plan.rows_by_mechanism() == {"copy": 300, "kernel": 100}
    else:  # page_first with one-slot pages: no host run is longer than a page
        assert plan.path is TransferPath.KERNEL
        assert plan.rows_by_mechanism() == {"kernel": 400}
    assert plan.sms_used == plan.kernel.sm_budget
    _run_and_check(plan, host, dev, hs, ds, layout)


def _run_and_check(plan, host: HostPool, dev: DevicePool, hs, ds, layout: HostLayout, grouped=False) -> None:
    """Run `plan` on CPU pools; every pair moved, no other row of the destination touched.

    Loads run layer by layer, or with `grouped` all layers in one `load_layers` call."""
    spec, direction = host.spec, plan.direction.value
    n_dev = dev.num_slots
    before_dev = {(b.name, lay): dev.layer(b.name, lay).clone() for b in spec.buffers for lay in b.layers}
    before_host = {b.name: [c.clone() for c in host.chunks(b.name)] for b in spec.buffers}
    if direction == "load" and grouped:
        load_layers(plan, host, dev, range(spec.num_layers))
    elif direction == "load":
        for layer in range(spec.num_layers):
            load_layer(plan, host, dev, layer)
    else:
        backup(plan, dev, host)
    for b in spec.buffers:
        for layer in b.layers:
            for i in range(len(hs)):
                h, d = int(hs[i]), int(ds[i])
                if direction == "load":
                    assert same_bytes(dev.layer(b.name, layer)[d], host_row(host, b, layer, h))
                else:
                    assert same_bytes(host_row(host, b, layer, h), before_dev[(b.name, layer)][d])
        if direction == "load":  # no other device row changed
            keep = torch.ones(n_dev, dtype=torch.bool)
            keep[ds] = False
            for layer in b.layers:
                assert same_bytes(dev.layer(b.name, layer)[keep], before_dev[(b.name, layer)][keep])
        else:  # no other host row changed
            keep = torch.ones(host.num_slots, dtype=torch.bool)
            keep[hs] = False
            idx = keep.nonzero().flatten()
            (chunk,) = host.chunks(b.name)
            (old,) = before_host[b.name]
            if layout is HostLayout.LAYER_FIRST:
                assert same_bytes(chunk[:, idx], old[:, idx])
            else:
                rows = _pf_rows(idx, len(b.layers))
                assert same_bytes(chunk.flatten(0, 2)[rows], old.flatten(0, 2)[rows])


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_long_host_runs_onto_scattered_device_slots_are_loaded_through_staging(direction, layout, gen):
    """A split plan: a long joint run copied, long host runs staged (cut at windows), short rows by kernel."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 2048, layout), DevicePool(spec, 2048, staging_tokens=100)
    poison_host(host, gen)
    poison_device(dev, gen)
    scattered = torch.randperm(1400, generator=gen)
    short_host = 1000 + torch.randperm(400, generator=gen)[:60]
    hs = torch.cat([torch.arange(0, 300), torch.arange(400, 650), short_host, torch.arange(700, 830)])
    ds = torch.cat([torch.arange(1500, 1800), scattered[:440]])
    costs = PathCosts(copy_min_bytes=100 * 48, staged_min_bytes=100 * 132)
    plan = Planner(host, dev, costs, use_kernel=True).plan(direction, hs, ds)
    if layout is HostLayout.LAYER_FIRST and direction == "backup":
        # Backups never stage through the copy engine; these small rows' host runs go through
        # staging by the kernel's units, the single rows to the kernel.
        by_buffer = {"copy": 300, "staged_kernel": 380, "kernel": 60}
        assert plan.mechanisms_by_buffer() == {"kv": by_buffer, "indexer": by_buffer}
        (staged,) = (p for p in plan.parts if p.mechanism is Mechanism.STAGED)
        # Apart in the staging buffer (below): windows of 64 rows cut the runs into 64, 64, 64, 58,
        # 6, 64 and 60 rows, whose gcd is the unit.
        assert staged.kernel is not None and staged.window_rows == 64 and staged.unit == 2
    elif layout is HostLayout.LAYER_FIRST:
        assert plan.path is TransferPath.MIXED
        assert plan.rows_by_mechanism() == {"copy": 300, "staged": 380, "kernel": 60}
        (staged,) = (p for p in plan.parts if p.mechanism is Mechanism.STAGED)
        # Each buffer its own place in the 13200-byte staging buffer (100 of the widest, 132-byte
        # rows): windows of (13200 - 128) // (48 + 132) = 72 rows, rounded down to 64
        # (`staging.WINDOW_ROWS`), the indexer's from byte 64 * 48 = 3072.
        assert staged.window_rows == 64 and staged.stage_at == {"kv": 0, "indexer": 3072}
        # 250 + 130 rows in windows of 64: runs cut at rows 64, 128, 192, 256 and 320 of the part
        windows = ((0, 64, 0, 1), (64, 128, 1, 2), (128, 192, 2, 3), (192, 256, 3, 5), (256, 320, 5, 6))
        assert staged.windows == (*windows, (320, 380, 6, 7))
        assert staged.runs.length.tolist() == [64, 64, 64, 58, 6, 64, 60]
    else:  # one-slot pages: no host run is longer than a page
        assert plan.path is TransferPath.KERNEL
    _run_and_check(plan, host, dev, hs, ds, layout)


@needs_triton
def test_staging_needs_host_runs_long_enough() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 4096), DevicePool(spec, 4096)
    scattered = torch.randperm(4096, generator=torch.Generator().manual_seed(3))
    runs = (torch.tensor([3, 1, 7])[:, None] * 512 + torch.arange(512)).flatten()

    def mechanisms(staged_rows: int) -> dict[str, dict[str, int]]:
        costs = PathCosts(copy_min_bytes=256 * 48, staged_min_bytes=staged_rows * 48)
        plan = Planner(host, dev, costs, use_kernel=True).plan("load", runs, scattered[:1536])
        return plan.mechanisms_by_buffer()

    assert mechanisms(512) == {"kv": {"staged": 1536}}
    # Shorter runs of these small rows go through staging by the kernel's units, not row by row.
    assert mechanisms(513) == {"kv": {"staged_kernel": 1536}}
    # A plan that would stage still refuses a repeated destination before anything is written.
    poison_device(dev, torch.Generator().manual_seed(4))
    before = dev.layer("kv", 0).clone()
    bad = scattered[:1536].clone()
    bad[700] = bad[3]
    costs = PathCosts(copy_min_bytes=256 * 48, staged_min_bytes=512 * 48)
    with pytest.raises(SlotError, match="repeats"):
        Planner(host, dev, costs, use_kernel=True).plan("load", runs, bad)
    assert same_bytes(dev.layer("kv", 0), before)


@needs_triton
@pytest.mark.parametrize("ps", [1, 16])
def test_kernel_moves_page_granular_runs_as_whole_pages(ps, gen):
    spec = preset("tiny-dsa", ps)
    host, dev = HostPool(spec, 512, "page_first"), DevicePool(spec, 512)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
    ds = (torch.randperm(512 // 16, generator=gen)[:8, None] * 16 + torch.arange(16)).flatten()
    plan = TransferPlan.build("load", host, dev, hs, ds, force="kernel", kernel=KernelOptions(2, 4))
    (part,) = plan.parts
    assert part.mechanism is Mechanism.KERNEL
    assert part.unit == ps  # page_first breaks host runs at pages, so a unit never crosses one
    for layer in range(spec.num_layers):
        load_layer(plan, host, dev, layer)
    for b in spec.buffers:
        for layer in b.layers:
            for i in range(len(hs)):
                assert same_bytes(dev.layer(b.name, layer)[int(ds[i])], host_row(host, b, layer, int(hs[i])))


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("spec_name", ["tiny-dsa", "tiny-mla-fp8", "tiny-mha"])
def test_page_first_kernel_rows_move_several_layers_per_launch(spec_name, ps, direction, gen, monkeypatch):
    """page_first keeps a page's layers together: one launch per buffer moves them all, byte for byte."""
    spec = preset(spec_name, ps)
    host, dev = HostPool(spec, 512, "page_first"), DevicePool(spec, 512)
    poison_host(host, gen)
    poison_device(dev, gen)
    pages = 100 // ps
    hs = (torch.randperm(512 // ps, generator=gen)[:pages, None] * ps + torch.arange(ps)).flatten()
    ds = (torch.randperm(512 // ps, generator=gen)[:pages, None] * ps + torch.arange(ps)).flatten()
    plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel", kernel=KernelOptions(2, 3))
    (part,) = plan.parts
    assert part.unit == ps and set(part.tables) == {b.name for b in spec.buffers}
    assert plan.sms_used == 2
    launches = []
    copy_groups = groups.copy_groups

    def spy(*args, **kwargs) -> None:
        launches.append(len(args[2]))  # the layers moved by this launch
        copy_groups(*args, **kwargs)

    monkeypatch.setattr(groups, "copy_groups", spy)
    _run_and_check(plan, host, dev, hs, ds, HostLayout.PAGE_FIRST, grouped=True)
    assert sorted(launches) == sorted(len(b.layers) for b in spec.buffers)


@needs_triton
def test_layer_first_kernel_rows_move_layer_by_layer(gen) -> None:
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 256, "layer_first"), DevicePool(spec, 256)
    hs, ds = torch.randperm(256, generator=gen)[:50], torch.randperm(256, generator=gen)[:50]
    plan = TransferPlan.build("load", host, dev, hs, ds, force="kernel")
    assert plan.parts[0].tables == {}
    _run_and_check(plan, host, dev, hs, ds, HostLayout.LAYER_FIRST, grouped=True)


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


@needs_triton
@pytest.mark.parametrize("stages", [None, 1])
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_kernel_on_a_small_budget_loops_over_many_tiles_byte_identically(
    direction, stages, gen, monkeypatch
) -> None:
    """sm_budget 2: each program loops over many tiles; loads of 1152-byte rows pipelined."""
    spec = preset("glm-5", 1).with_layers(1)
    host, dev = HostPool(spec, 4096, "layer_first"), DevicePool(spec, 4096)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = torch.randperm(4096, generator=gen)[:3000], torch.randperm(4096, generator=gen)[:3000]
    opts = KernelOptions(sm_budget=2, stages=stages)
    plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel", kernel=opts)
    (part,) = plan.parts
    assert part.mechanism is Mechanism.KERNEL and plan.sms_used == 2
    for b in spec.buffers:
        assert len(hs) > 2 * opts.launch(b.row_bytes, b.row_bytes).rows  # more than one tile each
    seen = {}
    real = kernels.copy_rows

    def spy(src, src_off, dst, dst_off, row_words, **kw):
        seen[row_words * src.element_size()] = kw["stages"]
        real(src, src_off, dst, dst_off, row_words, **kw)

    monkeypatch.setattr(kernels, "copy_rows", spy)
    _run_and_check(plan, host, dev, hs, ds, HostLayout.LAYER_FIRST)
    assert seen == {1152: (stages or launch.MAX_STAGES) if direction == "load" else 1, 132: 1}


def _glm5_pools_and_launches(gen, monkeypatch) -> tuple[HostPool, DevicePool, list]:
    """One layer of glm-5 in poisoned pools of 4096 slots, and the list every `copy_rows` call appends
    its `(row bytes, programs, rows per tile)` to."""
    spec = preset("glm-5", 1).with_layers(1)
    host, dev = HostPool(spec, 4096, "layer_first"), DevicePool(spec, 4096)
    poison_host(host, gen)
    poison_device(dev, gen)
    launches = []
    real = kernels.copy_rows

    def spy(src, src_off, dst, dst_off, row_words, **kw):
        launches.append((row_words * src.element_size(), kw["sm_budget"], kw["rows_per_program"]))
        real(src, src_off, dst, dst_off, row_words, **kw)

    monkeypatch.setattr(kernels, "copy_rows", spy)
    return host, dev, launches


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_long_rows_take_fewer_programs_than_the_budget(direction, gen, monkeypatch) -> None:
    """glm-5: 1152-byte rows on 2 programs (loads) or 4 (backups), 132-byte rows on all 8."""
    host, dev, launches = _glm5_pools_and_launches(gen, monkeypatch)
    hs, ds = torch.randperm(4096, generator=gen)[:3000], torch.randperm(4096, generator=gen)[:3000]
    plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel")
    assert plan.sms_used == 8 and plan.parts[0].programs == 8
    _run_and_check(plan, host, dev, hs, ds, HostLayout.LAYER_FIRST)
    # Loads of whole lines are pipelined (2 programs of 4 tiles of 56 rows), backups not (4 of 113).
    lean = (2, 56) if direction == "load" else (4, 113)
    assert sorted(launches) == [(132, 8, 256), (1152, *lean)]
    v3 = preset("deepseek-v3", 1).with_layers(1)
    pools = HostPool(v3, 4096), DevicePool(v3, 4096)
    assert TransferPlan.build(direction, *pools, hs, ds, force="kernel").sms_used == lean[0]
    full = KernelOptions(lean=False)
    assert TransferPlan.build(direction, *pools, hs, ds, force="kernel", kernel=full).sms_used == 8


@needs_triton
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_long_rows_over_a_wide_host_span_take_twice_the_lean_programs(direction, gen, monkeypatch) -> None:
    """glm-5's 1152-byte rows: a region's single rows spread over more than `WIDE_SPAN_BYTES` (here
    2 MiB) take 4 programs (loads) or 8 (backups), byte for byte; the same rows within 1 MiB, or host
    runs of 16 rows over the whole span, stay lean."""
    monkeypatch.setattr(launch, "WIDE_SPAN_BYTES", 2 << 20)
    host, dev, launches = _glm5_pools_and_launches(gen, monkeypatch)
    ds = torch.randperm(4096, generator=gen)[:800]
    # 4.7 MB of host rows (all 4096 slots) against 0.9 MB (the first 800), in random order.
    spread, near = torch.randperm(4096, generator=gen)[:800], torch.randperm(800, generator=gen)
    runs = (torch.randperm(256, generator=gen)[:50, None] * 16 + torch.arange(16)).flatten()
    for hs, wide in ((spread, True), (near, False), (runs, False)):
        launches.clear()
        plan = TransferPlan.build(direction, host, dev, hs, ds, force="kernel")
        assert {r.wide for r in plan.parts[0].regions["kv"]} == {wide}
        _run_and_check(plan, host, dev, hs, ds, HostLayout.LAYER_FIRST)
        lean = (2, 56) if direction == "load" else (4, 113)
        shape = ((4, 56) if direction == "load" else (8, 56)) if wide else lean
        assert [k for k in launches if k[0] == 1152] == [(1152, *shape)]
        assert plan.sms_used <= 8


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
    (part,) = plan.parts
    b = spec.buffer("indexer")
    for rows in part.regions["indexer"]:
        assert rows.word == word
        assert (rows.src * word % (b.row_bytes * part.unit) == 0).all()
        assert (rows.src % rows.align == 0).all() and (rows.dst % rows.align == 0).all()


@needs_triton
def test_planner_uses_the_kernel_for_short_runs_and_dma_for_long_ones() -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 4096), DevicePool(spec, 4096)
    costs = PathCosts(copy_min_bytes=256 * 48)

    def path(hs, ds) -> TransferPath:
        return Planner(host, dev, costs, use_kernel=True).plan("load", hs, ds).path

    runs = (torch.tensor([3, 1, 7])[:, None] * 512 + torch.arange(512)).flatten()
    assert path(runs, torch.arange(1536)) is TransferPath.BATCHED_DMA
    assert path(runs[::2], torch.arange(768)) is TransferPath.KERNEL
    assert path(torch.arange(10, 20), torch.arange(10)) is TransferPath.SINGLE_COPY
    with pytest.raises(PlanError, match="cannot be forced"):
        TransferPlan.build("load", host, dev, runs, torch.arange(1536), force="mixed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["load", "backup"])
def test_cuda_planner_paths_are_byte_identical(direction, gen) -> None:
    """On the GPU: batched DMA, staged, kernel and mixed plans against the host rows, on a side stream."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 8192), DevicePool(spec, 8192, "cuda", staging_tokens=1000)
    stream = torch.cuda.Stream()
    long_runs = (torch.tensor([1, 5, 3])[:, None] * 1024 + torch.arange(1024)).flatten()
    short = 6144 + torch.randperm(2048, generator=gen)[:500]
    cases = {
        TransferPath.BATCHED_DMA: (long_runs, torch.arange(3072)),
        TransferPath.KERNEL: (short, torch.randperm(8192, generator=gen)[:500]),
        TransferPath.MIXED: (
            torch.cat([long_runs, short]),
            torch.cat([torch.arange(3072), 4000 + torch.arange(500)]),
        ),
    }
    # Many long runs: spread over 4 streams (fan-out), every other run skipped on the host.
    fanned = (torch.arange(0, 64, 2)[:, None] * 96 + torch.arange(96)).flatten()
    start = int(torch.randint(0, 20, (1,), generator=gen))
    cases[TransferPath.BATCHED_DMA, 4] = (fanned, start + torch.arange(3072))
    # The same host runs onto scattered device slots, staged in 4 windows: a load's runs by the copy
    # engine, each window's fanned out; a backup's by the kernel's units (rows under 256 bytes).
    cases[TransferPath.STAGED, 4] = (fanned, torch.randperm(8192, generator=gen)[:3072])
    # Thresholds count each buffer's own rows: the narrowest here are the kv's 48 bytes.
    costs = PathCosts(copy_min_bytes=512 * 48)
    for expected, (hs, ds) in cases.items():
        streams = 8
        if isinstance(expected, tuple):
            expected, streams = expected
            costs = PathCosts(copy_min_bytes=96 * 48, staged_min_bytes=96 * 48, copy_streams=streams)
        poison_host(host, gen)
        poison_device(dev, gen)
        plan = TransferPlan.build(direction, host, dev, hs, ds, costs=costs, stream=stream)
        assert plan.path is expected
        assert all(
            p.streams == streams for p in plan.parts if isinstance(p, (CopyPart, StagedPart)) and p.batched
        )
        if expected is TransferPath.STAGED:
            (part,) = plan.parts
            # A load's two buffers lie apart: windows of (132000 - 128) // 180 = 732 rows; a backup's
            # over these 32 host runs one after the other (`staging.APART_BACKUP_RUNS`).
            assert part.batched and len(part.windows) == (5 if direction == "load" else 4)
            assert part.apart == (direction == "load")
            assert (part.kernel is None) == (direction == "load")
        run_and_check(plan, host, dev, hs, ds, stream)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", list(Direction))
def test_cuda_staged_parts_with_passes_beside_the_copies_are_byte_identical(direction, gen) -> None:
    """Staged parts whose buffers lie apart run each window's device passes on the pass stream beside
    the other buffer's copies (a load's placing, a backup's gathering, the indexer's first): a
    GLM-5-shaped spec of three layers from contiguous host slots onto scattered ones (one part of
    both buffers, window by window, its places reused within and across layers), and after first-fit
    churn (whatever parts the planner makes), twice each on one stream, against the host rows."""
    from kvtier.bench.churn import after_churn

    spec = preset("glm-5").with_layers(3)
    host, dev = HostPool(spec, 16384), DevicePool(spec, 16384, "cuda", staging_tokens=1500)
    stream = torch.cuda.Stream()
    ds = torch.randperm(16384, generator=gen)[:6000]
    for hs in (torch.arange(100, 6100), after_churn("first_fit", 6000, 16384, 1, 8, 0)):
        plan = TransferPlan.build(direction, host, dev, hs, ds, stream=stream)
        if plan.host_runs == 1:
            (part,) = plan.parts
            assert isinstance(part, StagedPart) and part.apart and len(part.windows) == 5
        for _ in range(2):
            poison_host(host, gen)
            poison_device(dev, gen)
            run_and_check(plan, host, dev, hs, ds, stream)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_copy_addresses_are_those_of_the_rows_the_tensor_path_copies(layout) -> None:
    """A copy part's byte table, turned into raw addresses as the batched path does, points at the
    rows that the per-run path's tensor views copy."""
    spec = preset("tiny-dsa", 4)
    host = HostPool(spec, 512, layout, chunk_bytes=4096)
    dev = DevicePool(spec, 512)
    hs = torch.cat([torch.arange(40, 120), torch.arange(300, 380)])
    ds = torch.cat([torch.arange(0, 80), torch.arange(200, 280)])
    plan = TransferPlan.build("load", host, dev, hs, ds, force="per_run")
    (part,) = plan.parts
    seg = host.segment_slots
    for b in spec.buffers:
        region, host_off, dev_off, nbytes = part.run_bytes[b.name]
        for j, layer in enumerate(b.layers):
            host_ptrs = host.region_ptrs(b.name)[j, region] + host_off
            dev_ptrs = dev.layer_ptrs(b.name)[j] + dev_off
            for r, (h, d, n) in enumerate(part.runs.triples):
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
    for _ in range(5):
        hp = torch.randperm(pages, generator=rng)[: pages // 2].sort().values
        hp[: len(hp) // 3] = torch.arange(len(hp) // 3)  # some long runs across segment edges
        dp = torch.randperm(pages, generator=rng)[: len(hp)]
        hs = (hp[:, None] * ps + torch.arange(ps)).flatten()
        ds = (dp[:, None] * ps + torch.arange(ps)).flatten()
        a = TransferPlan.build("load", host, dev, hs, ds, force="per_run")
        b = Planner(host, dev, force="per_run").plan_allocated("load", hs, ds)
        assert (a.host_runs, a.device_runs, a.joint_runs) == (b.host_runs, b.device_runs, b.joint_runs)
        assert a.parts[0].runs.table.tolist() == b.parts[0].runs.table.tolist()


def _runs_of(slots: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal ascending runs of `slots`, cut arbitrarily more (callers may hand over split runs)."""
    out: list[tuple[int, int]] = []
    for s in slots.tolist():
        if out and out[-1][0] + out[-1][1] == s and len(out) % 3:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def _runs_table(part) -> list | None:
    return part.runs.table.tolist() if isinstance(part, (CopyPart, StagedPart)) else None


@pytest.mark.parametrize("layout", list(HostLayout))
def test_plans_from_run_lists_equal_plans_from_slots(layout) -> None:
    """A plan built from run lists is the slot-scan plan: same path, runs and addresses."""
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
    for hs, ds in cases:
        for force in (None, "per_run"):
            planner = Planner(host, dev, force=force, use_kernel=False)
            a = planner.plan("load", hs, ds)
            b = planner.plan_allocated("load", hs, ds, runs=(_runs_of(hs), _runs_of(ds)))
            assert (a.path, a.host_runs, a.device_runs, a.joint_runs) == (
                b.path,
                b.host_runs,
                b.device_runs,
                b.joint_runs,
            )
            assert [_runs_table(p) for p in a.parts] == [_runs_table(p) for p in b.parts]
            if a.path in (TransferPath.PER_RUN, TransferPath.SINGLE_COPY):
                for name in a.parts[0].run_bytes:
                    for x, y in zip(a.parts[0].run_bytes[name], b.parts[0].run_bytes[name], strict=True):
                        assert np.array_equal(x, y)
    with pytest.raises(PlanError, match="cover"):
        Planner(host, dev).plan_allocated("load", hs, ds, runs=([(0, 4)], [(0, 5)]))
    with pytest.raises(PlanError, match="the plan has"):
        Planner(host, dev).plan_allocated("load", hs, ds, runs=([(0, 4)], [(8, 4)]))


def test_copies_fan_out_in_contiguous_shares_of_about_equal_bytes() -> None:
    """`copy_runs(streams=k)` cuts the list into k contiguous shares by bytes, not counts (a share may
    be empty), and only where every stream gets two copies or more."""
    sizes = np.arange(1, 11, dtype=np.int64)
    bounds = dma.shares(sizes, 4)
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == 10 and bounds == sorted(bounds)
    per_share = [int(sizes[a:b].sum()) for a, b in itertools.pairwise(bounds)]
    assert max(per_share) - min(per_share) <= sizes.max()
    uneven = np.array([100, 1, 1, 1, 1, 1, 1, 1, 100, 100], dtype=np.int64)
    assert dma.shares(uneven, 4) == [0, 0, 8, 9, 10]  # the first stream gets nothing
    assert dma.fans_out(8, 4) and not dma.fans_out(7, 4) and not dma.fans_out(100, 1)


def test_batched_copies_fan_out_only_while_their_runs_are_short() -> None:
    """Runs averaging `fan_out_below_bytes` or more stay on one stream (no fork and join per layer)."""
    spec = preset("tiny-mla", 1)  # 48-byte rows
    runs = 16

    def streams(run: int, batched: bool = True, **kw) -> int:
        return copy_streams(spec, run * runs, runs, batched, PathCosts(copy_streams=4, **kw))

    assert streams(200) == 4  # 9.6 KB runs
    assert streams(200, fan_out_below_bytes=200 * 48) == 1
    assert streams(199, fan_out_below_bytes=200 * 48) == 4
    assert streams(8, batched=False) == 1


@pytest.mark.parametrize(
    ("costs", "field"),
    [
        (PathCosts(copy_streams=0), "copy_streams"),
        (PathCosts(backup_staged_floor_bytes=-1), "floor"),
        (PathCosts(backup_copy_share=1.0), "backup_copy_share"),
        (PathCosts(backup_copy_share=-0.1), "backup_copy_share"),
        (PathCosts(backup_copy_share=float("nan")), "backup_copy_share"),
        (PathCosts(copy_share_min_bytes=-1), "copy_share_min_bytes"),
    ],
)
def test_path_costs_out_of_range_are_refused(costs, field) -> None:
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(ConfigError, match=field):
        TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), costs=costs)


@pytest.mark.parametrize("flag", ["lean", "overlap"])
def test_kernel_option_flags_must_be_booleans(flag: str) -> None:
    """A flag given as a string ("no" would read as on) is refused before anything is planned."""
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 64), DevicePool(spec, 64)
    with pytest.raises(ConfigError, match=f"must be True or False, got {{'{flag}': 'no'}}"):
        opts = KernelOptions(**{flag: "no"})
        TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), kernel=opts)


@pytest.mark.parametrize("bad", [{"sm_budget": 0}, {"rows_per_program": 0}, {"stages": 0}, {"stages": -1}])
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
    """Through `cuda.bindings` a batch pays per Python int: plain copies up to 4 there, up to 1 direct."""
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.BATCH))
    pin(dma.DIRECT, lambda *_a: None)
    assert dma.small_batch() == 1
    pin(dma.DIRECT, None)
    assert dma.small_batch() == 4
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP))
    assert dma.small_batch() == 4


def test_plans_refuse_pools_they_were_not_built_for(gen) -> None:
    """A plan records its pools: a load or backup handed other pools raises before anything moves."""
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    other_host, other_dev = HostPool(spec, 256), DevicePool(spec, 256)
    hs, ds = torch.arange(0, 64), torch.arange(64, 128)
    planner = Planner(host, dev, force="per_run")
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
