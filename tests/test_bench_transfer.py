"""`kvtier bench transfer` on the CPU: its byte check, calls that move several layers, and its cells."""

from __future__ import annotations

import pytest
import torch

from kvtier.bench import transfer, transfer_report
from kvtier.errors import ConfigError
from kvtier.pool import HostLayout
from kvtier.spec import preset
from kvtier.transfer import kernels

needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's CPU interpreter"
)


def _config(layers: int, **kw) -> transfer.BenchConfig:
    kw = {"host_sets": ("runs-1",), "variants": ("planned", "kernel")} | kw
    kw = {"layout": HostLayout.PAGE_FIRST} | kw
    return transfer.BenchConfig(
        spec=preset("tiny-dsa", 1),
        tokens=64,
        device=torch.device("cpu"),
        repeats=1,
        warmup=0,
        cycles=1,
        batch=1,
        device_sets=("scattered",),
        layers=layers,
        **kw,
    )


@needs_triton
def test_calls_over_several_layers_are_checked_on_every_layer() -> None:
    rows, meta = transfer.run(_config(3))
    spec = preset("tiny-dsa", 1)
    assert meta["layers"] == 3
    assert meta["layer_bytes"] == 64 * sum(spec.layer_bytes_per_token(layer) for layer in range(3))
    assert rows and all(r.identical for r in rows)
    assert {r.path for r in rows} >= {"kernel"}


@needs_triton
def test_a_layer_the_call_skips_fails_the_check(monkeypatch) -> None:
    """The check covers every layer of the call: a load that drops the last one is caught."""
    real = transfer.load_layers
    monkeypatch.setattr(
        transfer, "load_layers", lambda plan, host, dev, layers, s: real(plan, host, dev, [0, 1], s)
    )
    rows, _ = transfer.run(_config(3, directions=(transfer.Direction.LOAD,)))
    assert rows and not any(r.identical for r in rows)


def test_more_layers_than_the_spec_has_are_refused() -> None:
    with pytest.raises(ValueError, match="layers 4"):
        transfer.run(_config(4))


def test_runs_of_any_length_are_a_host_set_and_unknown_sets_are_refused() -> None:
    cfg = _config(1, host_sets=("runs-5", "runs-1"), variants=("planned",), layout=HostLayout.LAYER_FIRST)
    rows, _ = transfer.run(cfg)
    runs = {r.host_runs: r.host_run_count for r in rows}
    assert all(r.identical for r in rows)
    # 13 runs of 5 slots at random places of the pool (neighbours may join), against ~64 lone slots.
    assert runs["runs-5"] <= 13 < 50 <= runs["runs-1"]
    for bad in ("runs-0", "runs-x", "striped"):
        with pytest.raises(ConfigError, match="unknown host slot set"):
            _config(1, host_sets=("runs-1", bad))


@needs_triton
def test_the_host_pool_s_slots_are_a_setting_and_fewer_than_the_tokens_are_refused(monkeypatch) -> None:
    """`host_slots` sizes the pool the sets are drawn from (default 2 x tokens), in the metadata."""
    seen = []
    real = transfer.HostPool

    def pool(spec, slots, layout):
        seen.append(slots)
        return real(spec, slots, layout)

    monkeypatch.setattr(transfer, "HostPool", pool)
    rows, meta = transfer.run(_config(1, host_slots=1024, variants=("planned",)))
    assert seen == [1024] and meta["host_slots"] == 1024 and all(r.identical for r in rows)
    _, meta = transfer.run(_config(1, variants=("planned",)))
    assert seen == [1024, 128] and meta["host_slots"] == 128
    with pytest.raises(ConfigError, match="host_slots 63 must be at least tokens 64"):
        _config(1, host_slots=63)


def _row(variant: str, ratio: float, tokens: int = 1024, host: str = "runs-1", **kw) -> transfer.Row:
    fields = dict(
        direction="load",
        path="kernel" if variant != "copy" else "copy",
        variant=variant,
        planned=variant == "planned",
        host_runs=host,
        host_run_count=7,
        device="scattered",
        tokens=tokens,
        nbytes=1,
        sms=0,
        kernel="",
        ms=1.0,
        gbps=1.0,
        ceiling_ratio=ratio,
        identical=True,
    )
    return transfer.Row(**(fields | kw))


def test_cells_name_the_best_forced_variant_and_the_planned_ones_gap_to_it() -> None:
    rows = [
        _row("planned", 0.80, path="mixed"),
        _row("kernel", 0.70),
        _row("copy", 0.85),
        _row("planned", 0.60, tokens=4096),
        _row("kernel", 0.50, tokens=4096, identical=False),
        _row("planned", 0.9, host="contiguous"),  # no forced variant timed here
        _row("copy", 0.9, host="runs-16"),  # no planned one
    ]
    cells = {(c["tokens"], c["host"]): c for c in transfer_report.cells(rows)}
    assert len(cells) == 4
    first = cells[1024, "runs-1"]
    assert first["ratios"] == {"planned": 0.80, "kernel": 0.70, "copy": 0.85}
    assert (first["best_forced"], first["gap"], first["path"], first["identical"]) == (
        "copy",
        -0.05,
        "mixed",
        True,
    )
    assert first["runs"] == 7 and first["direction"] == "load" and first["device"] == "scattered"
    second = cells[4096, "runs-1"]
    assert (second["best_forced"], second["gap"], second["identical"]) == ("kernel", 0.1, False)
    assert (cells[1024, "contiguous"]["best_forced"], cells[1024, "contiguous"]["gap"]) == (None, None)
    assert (cells[1024, "runs-16"]["best_forced"], cells[1024, "runs-16"]["gap"]) == ("copy", None)
    assert "path" not in cells[1024, "runs-16"]


@needs_triton
def test_the_default_variants_are_timed_and_checked_on_every_host_set() -> None:
    """planned, fixed, kernel and copy on a run, runs of 16 and single rows: every one byte-checked; the
    forced ones took their paths; one cell per host set and direction, with planned against fixed."""
    cfg = _config(1, host_sets=("contiguous", "runs-16", "runs-1"), variants=transfer.DEFAULT_VARIANTS)
    rows, meta = transfer.run(cfg)
    assert meta["tokens"] == 64
    assert {(r.host_runs, r.variant) for r in rows} == {
        (h, v) for h in ("contiguous", "runs-16", "runs-1") for v in ("planned", "fixed", "kernel", "copy")
    }
    assert all(r.identical for r in rows)
    assert all(r.path == r.variant for r in rows if r.variant in ("kernel", "copy"))
    found = transfer_report.cells(rows)
    assert [c["best_forced"] in ("kernel", "copy") for c in found] == [True] * 6
    assert all(c["vs_fixed"] is not None for c in found)


@needs_triton
def test_variants_that_run_one_plan_are_timed_once_and_share_its_time(monkeypatch) -> None:
    """One run of slots: the planner's plan is one copy, as is `fixed`'s (the same costs) and the copy
    engine's forced: that plan is timed once and its time is theirs; the kernel's, a different plan,
    is timed apart."""
    timed: list[str] = []
    real = transfer.plan_op

    def counting(plan, *args):
        timed.append(plan.path.value)
        return real(plan, *args)

    monkeypatch.setattr(transfer, "plan_op", counting)
    monkeypatch.setattr(transfer, "check_plan", lambda s, plan: True)  # checked elsewhere; not run here
    cfg = _config(
        1,
        host_sets=("contiguous",),
        variants=("planned", "fixed", "kernel", "copy"),
        layout=HostLayout.LAYER_FIRST,
    )
    cfg.directions, cfg.device_sets = (transfer.Direction.LOAD,), ("contiguous",)
    rows, _ = transfer.run(cfg)
    by = {r.variant: r for r in rows}
    assert by["planned"].path == "copy" and by["planned"].same_plan_as == ""
    assert by["fixed"].same_plan_as == "planned" and by["copy"].same_plan_as == "planned"
    assert by["kernel"].same_plan_as == "" and by["kernel"].path == "kernel"
    assert by["fixed"].ms == by["copy"].ms == by["planned"].ms
    assert timed == ["copy", "kernel"]  # two distinct plans timed
    cell = transfer_report.cells(rows)[0]
    assert cell["same_plan"] == {"fixed": "planned", "copy": "planned"}
    # The host's time to issue a call is kept per variant; on the CPU the call is its issue.
    assert all(r.issue_ms > 0 for r in rows) and set(cell["host_bound"]) == set(by)
    host, dev = _pools()
    one = [
        transfer.TransferPlan.build("load", host, dev, torch.arange(8), torch.arange(8), force=f)
        for f in ("kernel", "copy", "copy")
    ]
    assert transfer.plan_key(one[0]) != transfer.plan_key(one[1]) == transfer.plan_key(one[2])


def _pools():
    spec = preset("tiny-dsa", 1)
    from kvtier.pool import DevicePool, HostPool

    return HostPool(spec, 64), DevicePool(spec, 64)
