"""`kvtier bench transfer --gpus N` on the CPU: its refusals, two ranks in two processes, NUMA from sysfs.

The ranks run on CPU devices (Triton's interpreter where a plan takes the kernel), each in
its own spawned process over a gloo group: the same processes, collectives, byte checks and
timings as on GPUs, at toy sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kvtier import cli
from kvtier.bench import transfer, transfer_gpus
from kvtier.errors import RankError
from kvtier.pool import HostLayout, numa
from kvtier.spec import preset

CPU = torch.device("cpu")


def _config(**kw) -> transfer.BenchConfig:
    base = dict(
        spec=preset("tiny-mla", 1),
        tokens=64,
        layout=HostLayout.LAYER_FIRST,
        device=CPU,
        repeats=2,
        warmup=1,
        cycles=1,
        batch=2,
        host_sets=("contiguous", "runs-1"),
        device_sets=("contiguous", "scattered"),
    )
    return transfer.BenchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def two_ranks() -> tuple[list[transfer_gpus.GpusRow], dict]:
    return transfer_gpus.run(_config(), [CPU, CPU])


# -- refusals, through the CLI, before anything is allocated ---------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], "--gpus 0 must be at least 1"),
        (["--gpus", "-1"], "--gpus -1 must be at least 1"),
        (["--gpus", "2", "--device", "cpu"], "--gpus 2 needs CUDA devices, got --device cpu"),
        (["--gpus", "64"], "--gpus 64: this machine has"),
        (["--gpus", "64", "--device", "cuda"], "--gpus 64: this machine has"),
        (["--gpus", "2", "--device", "cuda:1"], "give --device cuda or auto, not cuda:1"),
        (["--gpus", "2", "--variants", "kernel"], "--variants kernel needs one GPU"),
        (["--gpus", "2", "--kernel-sweep", "4x32"], "--kernel-sweep times one GPU's kernel shapes"),
    ],
)
def test_gpus_the_machine_or_the_flags_cannot_give_are_refused_in_one_line(
    flags: list[str], message: str, capsys, monkeypatch
) -> None:
    def spawned(*_args, **_kw):
        raise AssertionError("a refused run spawned its ranks")

    monkeypatch.setattr(transfer_gpus.mp, "spawn", spawned)
    assert cli.main(["bench", "transfer", "--spec", "tiny-mla", "--tokens", "64", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier bench transfer: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


# -- two ranks on the CPU ----------------------------------------------------------------------


def test_two_ranks_give_a_row_per_case_with_every_rank_checked(two_ranks) -> None:
    rows, meta = two_ranks
    cases = {(r.direction, r.host_runs, r.device) for r in rows}
    assert cases == {
        (d, h, v)
        for d in ("load", "backup")
        for h in ("contiguous", "runs-1")
        for v in ("contiguous", "scattered")
    }
    for row in rows:
        assert row.gpus == 2 and [k.rank for k in row.ranks] == [0, 1]
        assert row.identical and all(k.identical for k in row.ranks)
        # The same seed gives every rank the same slot sets, so the same plan.
        assert {k.path for k in row.ranks} == {row.path}
        assert row.ms > 0 and row.aggregate_ratio > 0 and row.start_skew_ms >= 0
        assert row.nbytes == meta["layer_bytes"] == 64 * preset("tiny-mla", 1).layer_bytes_per_token(0)
    runs = {r.host_runs: r.host_run_count for r in rows}
    assert runs["contiguous"] == 1 and runs["runs-1"] > 1


def test_the_report_names_every_rank_and_survives_json(two_ranks) -> None:
    rows, meta = two_ranks
    report = json.loads(json.dumps(transfer_gpus.as_json(rows, meta)))
    assert report["meta"]["gpus"] == 2 and report["meta"]["spec"] == "tiny-mla"
    ranks = report["meta"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["device"] for r in ranks} == {"cpu"}
    assert all(r["numa_node"] is None and set(r["ceiling_gbps"]) == {"load", "backup"} for r in ranks)
    row = report["rows"][0]
    assert set(row) >= {"gpus", "aggregate_gbps", "aggregate_ratio", "one_gpu_gbps", "ranks", "identical"}
    assert set(row["ranks"][0]) == {
        "rank",
        "path",
        "alone_gbps",
        "together_gbps",
        "ceiling_ratio",
        "identical",
    }
    console = Console(width=200, record=True)
    console.print(transfer_gpus.render(rows, meta))
    text = console.export_text()
    assert "2 GPUs at once" in text and "runs-1" in text and "NO" not in text


def test_a_rank_that_fails_ends_the_run_with_its_error() -> None:
    with pytest.raises(RankError, match=r"rank \d of 2 failed: ConfigError: layers 9 must be in \[1, "):
        transfer_gpus.run(_config(layers=9), [CPU, CPU])


# -- NUMA from sysfs ------------------------------------------------------------------------


def test_the_numa_node_of_a_pci_device_is_read_from_sysfs(tmp_path: Path) -> None:
    for bus, text in (("0000:1b:00.0", "1\n"), ("0000:3d:00.0", "-1\n"), ("0000:5e:00.0", "x\n")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "numa_node").write_text(text)
    assert numa.node_of("0000:1b:00.0", tmp_path) == 1
    assert numa.node_of("0000:3d:00.0", tmp_path) is None  # the machine shows no NUMA
    assert numa.node_of("0000:5e:00.0", tmp_path) is None
    assert numa.node_of("0000:99:00.0", tmp_path) is None
    assert numa.node_of(numa.pci_bus_id(CPU), tmp_path) is None


def test_a_nodes_cpus_are_read_from_its_cpulist(tmp_path: Path) -> None:
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("0-3,8,10-11\n")
    assert numa.node_cpus(1, tmp_path) == {0, 1, 2, 3, 8, 10, 11}
    assert numa.node_cpus(2, tmp_path) == frozenset()
