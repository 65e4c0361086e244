"""The planner's cost models: measured rates turned into choices, their cache file, and plans made on them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import host_row, poison_device, poison_host, same_bytes

from kvtier import cli
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import Planner, backup, calibrate, kernels, load_layers
from kvtier.transfer.costs import NEVER, Choice, CostModel, Rates
from kvtier.transfer.options import PathCosts

needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's interpreter"
)

# A copy engine that reaches 50 GB/s from 64 KiB pieces and 55 GB/s at 1 MiB.
COPY = {1 << 10: 1.0, 16 << 10: 10.0, 64 << 10: 50.0, 1 << 20: 55.0}


def rates(rows: float, units: float, row_bytes: int = 132, device: float = 1800.0) -> Rates:
    return Rates(COPY, device, COPY, {row_bytes: rows}, {row_bytes: units}, {row_bytes: 25.0})


def test_a_row_size_the_model_did_not_measure_has_no_choice() -> None:
    model = CostModel("calibrated test", {Direction.LOAD: rates(28.0, 47.0)})
    assert model.choice(1152, Direction.LOAD) is None
    assert model.choice(132, Direction.BACKUP) is None
    assert model.choice(132, Direction.LOAD) is not None


def test_the_copy_engine_takes_runs_from_where_it_keeps_up_with_the_kernel() -> None:
    slow = Choice.of(rates(28.0, 40.0), 132, "m")
    fast = Choice.of(rates(28.0, 54.0), 132, "m")
    never = Choice.of(rates(28.0, 60.0), 132, "m")
    assert slow is not None and fast is not None and never is not None
    assert 16 << 10 < slow.copy_min_bytes <= 64 << 10  # 40 GB/s is reached between 16 and 64 KiB
    assert 64 << 10 < fast.copy_min_bytes <= 1 << 20
    assert never.copy_min_bytes == NEVER  # the copy engine never reaches 60 / 1.02 GB/s


def test_small_rows_go_through_staging_by_the_kernel_only_where_its_units_beat_single_rows() -> None:
    small = Choice.of(rates(28.0, 47.0), 132, "m")  # units far faster than scattered single rows
    wide = Choice.of(rates(50.0, 50.3, 1152), 1152, "m")  # units no faster: no kernel staging
    assert small is not None and wide is not None
    assert small.kernel_staged_below > 0
    assert wide.kernel_staged_below == 0
    # Staging by the copy engine needs a rate the copy and the device pass reach together.
    assert wide.staged_min_bytes > 64 << 10
    assert small.staged_min_bytes <= 64 << 10


def test_staging_measured_whole_decides_which_host_runs_it_takes() -> None:
    """With staging timed whole, a host run goes through it from where that rate reaches the kernel's
    on scattered single rows, whatever the copies and the device pass would give added up."""
    composed = rates(50.0, 50.3, 1152)
    staged = {16 << 10: 20.0, 64 << 10: 45.0, 256 << 10: 49.0, 1 << 20: 53.0}
    measured = Rates(COPY, 1800.0, COPY, {1152: 50.0}, {1152: 50.3}, {1152: 25.0}, staged)
    slower = Rates(COPY, 1800.0, COPY, {1152: 50.0}, {1152: 50.3}, {1152: 25.0}, {1 << 20: 49.0})
    added = Choice.of(composed, 1152, "m")
    whole = Choice.of(measured, 1152, "m")
    never = Choice.of(slower, 1152, "m")
    assert added is not None and whole is not None and never is not None
    assert added.staged_min_bytes < 256 << 10  # 55 GB/s copies with a 1800 GB/s pass beat 50 from there
    assert 256 << 10 < whole.staged_min_bytes <= 1 << 20  # staging whole reaches 50 GB/s past 256 KiB
    assert never.staged_min_bytes == NEVER
    assert whole.copy_min_bytes == added.copy_min_bytes  # joint runs: the copy curve, as before
    assert measured.staged_from(45.0) == 64 << 10


def test_the_defaults_stage_small_rows_by_the_kernel_and_only_long_host_runs_by_the_copy_engine() -> None:
    costs = PathCosts()
    indexer = Choice.fallback(costs, Direction.LOAD, 132, 1152)
    latent = Choice.fallback(costs, Direction.LOAD, 1152, 1152)
    latent_backup = Choice.fallback(costs, Direction.BACKUP, 1152, 1152)
    assert latent.copy_min_bytes == indexer.copy_min_bytes == costs.copy_min_bytes
    assert latent.staged_min_bytes == costs.staged_min_bytes and latent.kernel_staged_below == 0
    assert indexer.staged_min_bytes == costs.copy_min_bytes == indexer.kernel_staged_below
    assert latent_backup.staged_min_bytes == costs.backup_staged_min_bytes
    assert latent.source == "defaults"


def test_a_model_survives_its_json_and_bad_rates_are_refused() -> None:
    model = CostModel("calibrated x", {d: rates(28.0, 47.0) for d in Direction})
    again = CostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert again == model
    staged = Rates(COPY, 1800.0, COPY, {132: 28.0}, {132: 47.0}, {}, {64 << 10: 40.0})
    with_staged = CostModel("calibrated y", {Direction.BACKUP: staged})
    assert CostModel.from_json(json.loads(json.dumps(with_staged.to_json()))) == with_staged
    older = model.to_json()
    del older["rates"]["load"]["staged"]  # a model from before staging was timed whole
    assert CostModel.from_json(older).rates[Direction.LOAD].staged == {}
    data = model.to_json()
    data["rates"]["load"]["kernel_rows"]["132"] = -1.0
    with pytest.raises(ValueError, match="non-positive"):
        CostModel.from_json(data)
    data = model.to_json()
    data["rates"]["load"]["copy"] = {}
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_json(data)


def test_the_cache_file_is_written_whole_and_an_unreadable_one_is_ignored(tmp_path, caplog) -> None:
    model = CostModel("calibrated x", {d: rates(28.0, 47.0) for d in Direction})
    path = tmp_path / "calibration" / "gpu.json"
    calibrate.write(path, model)
    assert calibrate.read(path) == model
    assert [p.name for p in path.parent.iterdir()] == ["gpu.json"]  # no temporary file left
    path.write_text("{not json")
    assert calibrate.read(path) is None
    assert "ignoring the calibration file" in caplog.text
    path.write_text(json.dumps({"format": calibrate.FORMAT - 1, "model": model.to_json()}))
    assert calibrate.read(path) is None  # measured by an older method: measured again
    assert calibrate.read(tmp_path / "missing.json") is None


def test_calibration_is_opt_in_and_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_CALIBRATION", raising=False)
    assert not calibrate.enabled()
    monkeypatch.setenv("KVTIER_CALIBRATION", "on")
    assert calibrate.enabled()
    assert calibrate.model_for(torch.device("cpu"), [132]) is None


def test_kvtier_calibrate_refuses_the_cpu_in_one_line(capsys) -> None:
    assert cli.main(["calibrate", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier calibrate: error:") and "\n" not in err


@needs_triton
@pytest.mark.parametrize("direction", list(Direction))
def test_a_plan_on_a_model_moves_each_buffer_its_own_way_byte_for_byte(direction, gen) -> None:
    """Host runs of 32 slots onto scattered device slots: the model sends the 48-byte rows through
    staging by the copy engine and the 132-byte indexer rows through staging by the kernel."""
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 1024, HostLayout.LAYER_FIRST), DevicePool(spec, 1024, staging_tokens=100)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = (torch.tensor([1, 5, 9, 20])[:, None] * 32 + torch.arange(32)).flatten()
    ds = torch.randperm(1024, generator=gen)[: hs.numel()]
    kv = Rates({1 << 10: 60.0, 1 << 20: 60.0}, 1800.0, {}, {48: 20.0}, {48: 21.0}, {})
    indexer = Rates({1 << 10: 1.0, 1 << 20: 2.0}, 1800.0, {}, {132: 20.0}, {132: 50.0}, {})
    both = Rates(
        kv.copy, 1800.0, {}, kv.kernel_rows | indexer.kernel_rows, kv.kernel_units | indexer.kernel_units
    )
    model = CostModel("calibrated test", {d: both for d in Direction})
    choices = {rb: Choice.of(r, rb, "calibrated test") for r, rb in ((kv, 48), (indexer, 132))}
    assert choices[48].staged_min_bytes < 32 * 48 and choices[132].kernel_staged_below > 32 * 132
    planner = Planner(host, dev, use_kernel=True, model=model)
    plan = planner.plan(direction, hs, ds)
    assert plan.cost_model == "calibrated test"
    by = plan.mechanisms_by_buffer()
    assert by["kv"] == {"staged": 128} and by["indexer"] == {"staged": 128}  # copy rate 60: both by copy
    # Now the indexer's copy engine is slow: its rows go through the kernel's units into staging.
    slow = Rates(indexer.copy, 1800.0, {}, both.kernel_rows, both.kernel_units)
    model = CostModel("calibrated slow", {d: slow for d in Direction})
    plan = Planner(host, dev, use_kernel=True, model=model).plan(direction, hs, ds)
    assert plan.mechanisms_by_buffer()["indexer"] == {"staged_kernel": 128}
    before = {(b.name, layer): dev.layer(b.name, layer).clone() for b in spec.buffers for layer in b.layers}
    if direction is Direction.LOAD:
        load_layers(plan, host, dev, range(spec.num_layers))
    else:
        backup(plan, dev, host)
    for b in spec.buffers:
        for layer in b.layers:
            for h, d in zip(hs.tolist(), ds.tolist(), strict=True):
                src = host_row(host, b, layer, h)
                want = (
                    dev.layer(b.name, layer)[d] if direction is Direction.LOAD else before[(b.name, layer)][d]
                )
                assert same_bytes(want, src)
            if direction is Direction.LOAD:
                keep = torch.ones(dev.num_slots, dtype=torch.bool)
                keep[ds] = False
                assert same_bytes(dev.layer(b.name, layer)[keep], before[(b.name, layer)][keep])
