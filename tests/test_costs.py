"""The planner's cost models: measured rates turned into choices, their cache file, and plans made on them."""

from __future__ import annotations

import dataclasses
import fcntl
import json

import pytest
import torch
from conftest import host_row, poison_device, poison_host, run_and_check, same_bytes

from kvtier import cli
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import mla_spec, preset
from kvtier.transfer import Planner, backup, calibrate, kernels, load_layers
from kvtier.transfer.costs import NEVER, Choice, CostModel, Rates
from kvtier.transfer.options import PathCosts

needs_triton = pytest.mark.skipif(
    not kernels.runs_on(torch.device("cpu")), reason="needs Triton's interpreter"
)

# A copy engine that reaches 50 GB/s from 64 KiB pieces and 55 GB/s at 1 MiB.
COPY = {1 << 10: 1.0, 16 << 10: 10.0, 64 << 10: 50.0, 1 << 20: 55.0}
# Staging timed whole: 45 GB/s from 64 KiB host runs, 49 at 256 KiB, 53 at 1 MiB.
STAGED = {16 << 10: 20.0, 64 << 10: 45.0, 256 << 10: 49.0, 1 << 20: 53.0}


def rates(
    rows: float, units: float, row_bytes: int = 132, device: float = 1800.0, staged: dict | None = None
) -> Rates:
    return Rates(
        COPY,
        COPY,
        device_pass={row_bytes: device},
        kernel_rows={row_bytes: rows},
        kernel_units={row_bytes: units},
        strided={row_bytes: 25.0},
        staged={row_bytes: STAGED if staged is None else staged},
    )


def indexer_and_latent(copy: dict[int, float], staged: dict[int, dict[int, float]]) -> Rates:
    """Rates of 132-byte rows (the kernel 28 GB/s, its units 47) and 1152-byte rows (50, 50.3), the
    copy engine at `copy`, staging whole at `staged`."""
    return Rates(
        copy,
        copy,
        device_pass={132: 1800.0, 1152: 1800.0},
        kernel_rows={132: 28.0, 1152: 50.0},
        kernel_units={132: 47.0, 1152: 50.3},
        staged=staged,
    )


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
    slow_pass = Choice.of(rates(28.0, 47.0, device=60.0), 132, "m")  # units + a slow pass lose to rows
    assert small is not None and wide is not None and slow_pass is not None
    # Units then the 1800 GB/s pass: 45.8 GB/s, which staging by the copy engine reaches past 64 KiB.
    assert 64 << 10 < small.kernel_staged_below == small.staged_min_bytes < 256 << 10
    assert wide.kernel_staged_below == 0 and slow_pass.kernel_staged_below == 0
    # Against the kernel's 50 GB/s on single rows, staging by the copy engine pays from past 256 KiB;
    # against its 28, from between 16 and 64 KiB.
    assert 256 << 10 < wide.staged_min_bytes <= 1 << 20
    assert 16 << 10 < slow_pass.staged_min_bytes < small.staged_min_bytes


def test_staging_measured_whole_per_row_size_decides_which_host_runs_it_takes() -> None:
    """A host run goes through staging by the copy engine from where that rate, timed whole on its own
    rows, reaches the best the kernel does without it; the same copy engine with a slower staging
    curve for small rows keeps their host runs of 33 KB (runs of 256 indexer rows) on the kernel's units."""
    fast = rates(28.0, 47.0, staged={16 << 10: 40.0, 32 << 10: 47.0, 1 << 20: 53.0})
    slow = rates(28.0, 47.0, staged={16 << 10: 38.0, 32 << 10: 44.0, 256 << 10: 50.0})
    never = rates(50.0, 50.3, 1152, staged={1 << 20: 49.0})
    a, b, c = Choice.of(fast, 132, "m"), Choice.of(slow, 132, "m"), Choice.of(never, 1152, "m")
    assert a is not None and b is not None and c is not None
    run = 256 * 132
    assert a.staged_min_bytes <= run  # staged by the copy engine
    assert b.staged_min_bytes > run and b.kernel_staged_below > run  # staged by the kernel's units
    assert c.staged_min_bytes == NEVER and c.kernel_staged_below == 0
    assert a.copy_min_bytes == b.copy_min_bytes  # joint runs: the copy curve, whatever staging costs
    assert fast.staged_from(132, 47.0) == pytest.approx(32 << 10, rel=0.02)  # on a grid of 256 sizes
    assert slow.staged_gbps(132, 32 << 10) == pytest.approx(44.0)


def test_the_planners_floor_keeps_short_runs_off_the_copy_engine_whatever_the_model_says() -> None:
    """With a floor of 64 KiB, a model whose copy engine keeps up from 16 KiB still sends shorter
    joint runs to the kernel and stages shorter host runs by the kernel's units; longer thresholds
    are the model's own."""
    quick = {16 << 10: 54.0, 1 << 20: 55.0}
    r = indexer_and_latent(quick, {132: quick, 1152: {16 << 10: 20.0, 1 << 20: 53.0}})
    free = {rb: Choice.of(r, rb, "m") for rb in (132, 1152)}
    model = CostModel("m", {Direction.LOAD: r})
    floored = {rb: model.choice(rb, Direction.LOAD, 64 << 10) for rb in (132, 1152)}
    assert free[132].copy_min_bytes <= 16 << 10 and free[132].staged_min_bytes <= 16 << 10
    assert floored[132].copy_min_bytes == floored[132].staged_min_bytes == 64 << 10
    assert floored[132].kernel_staged_below == 64 << 10  # units still beat single rows below it
    assert floored[1152].staged_min_bytes == free[1152].staged_min_bytes > 64 << 10
    assert floored[1152].kernel_staged_below == free[1152].kernel_staged_below == 0


def test_a_model_stages_a_backups_host_runs_by_the_copy_engine_only_from_the_backup_floor() -> None:
    """Staging that reaches the kernel's rate from ~50 KiB: a load's host runs are staged from there, a
    backup's only from `backup_staged_floor_bytes` of the widest rows, scaled to each buffer's rows
    (never under the copy floor); the model's own threshold where it is higher, or where the kernel's
    units beat its single rows (the floor would send longer runs through them)."""
    staged = {16 << 10: 20.0, 64 << 10: 52.0, 1 << 20: 55.0}
    r = indexer_and_latent(COPY, {132: staged, 1152: staged})
    model = CostModel("m", {d: r for d in Direction})
    costs = PathCosts()
    load, back = (model.planned(costs, 1152, d, 1152) for d in (Direction.LOAD, Direction.BACKUP))
    assert load.staged_min_bytes == costs.copy_min_bytes  # the curve alone says ~50 KiB
    assert back.staged_min_bytes == costs.backup_staged_floor_bytes == 384 << 10
    assert back.copy_min_bytes == load.copy_min_bytes  # joint runs are not floored by it
    # 656-byte rows whose units lose to single rows (50.0 against 49.5 x 1.02) are floored at their
    # share of the widest rows; 132-byte rows whose units win (47 GB/s against 28) are not.
    rb, speeds = (656, 132), {656: (49.5, 50.0), 132: (28.0, 47.0)}
    r2 = Rates(
        COPY,
        COPY,
        device_pass=dict.fromkeys(rb, 1800.0),
        kernel_rows={k: v[0] for k, v in speeds.items()},
        kernel_units={k: v[1] for k, v in speeds.items()},
        staged=dict.fromkeys(rb, staged),
    )
    wide = PathCosts(backup_staged_floor_bytes=1 << 20)
    two = CostModel("m", {Direction.BACKUP: r2})
    packed = two.planned(wide, 656, Direction.BACKUP, 1152)
    assert packed.staged_min_bytes == (1 << 20) * 656 / 1152 and packed.kernel_staged_below == 0
    indexer = two.planned(wide, 132, Direction.BACKUP, 1152)
    assert indexer.staged_min_bytes == indexer.kernel_staged_below == 64 << 10
    late = {16 << 10: 20.0, 1 << 20: 50.0}  # staging reaches the kernel at 1 MiB only
    r_late = dataclasses.replace(r, staged={132: late, 1152: late})
    own = CostModel("m", {Direction.BACKUP: r_late}).planned(costs, 1152, Direction.BACKUP, 1152)
    assert own.staged_min_bytes > 900 << 10


@needs_triton
@pytest.mark.parametrize("direction", list(Direction))
def test_a_planner_on_a_model_keeps_a_backups_host_runs_under_the_floor_on_the_kernel(direction, gen) -> None:
    """Host runs of 256 rows of 1152 bytes (295 KB) onto scattered device slots, on a model whose staging
    reaches the kernel's rate from 64 KiB: a load stages them, a backup leaves them to the kernel
    (under the 384 KiB floor; no share for the copy engine beside it here), byte for byte either way."""
    spec = mla_spec("one-layer", 1, 512, 64, torch.bfloat16)
    host, dev = HostPool(spec, 4096, HostLayout.LAYER_FIRST), DevicePool(spec, 4096)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs = (torch.tensor([0, 3, 6, 9])[:, None] * 256 + torch.arange(256)).flatten()
    ds = torch.randperm(4096, generator=gen)[: hs.numel()]
    staged = {16 << 10: 20.0, 64 << 10: 52.0, 1 << 20: 55.0}
    model = CostModel(
        "calibrated z", {d: rates(50.0, 50.3, row_bytes=1152, staged=staged) for d in Direction}
    )
    plan = Planner(host, dev, PathCosts(backup_copy_share=0), use_kernel=True, model=model).plan(
        direction, hs, ds
    )
    want = "staged" if direction is Direction.LOAD else "kernel"
    assert plan.mechanisms_by_buffer() == {"kv": {want: 1024}}
    run_and_check(plan, host, dev, hs, ds, None)


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
    assert again.rates[Direction.LOAD].staged == {132: STAGED}
    for table, key in (("kernel_rows", "132"), ("staged", "132")):
        data = model.to_json()
        if table == "staged":
            data["rates"]["load"]["staged"][key]["65536"] = 0.0
        else:
            data["rates"]["load"][table][key] = -1.0
        with pytest.raises(ValueError, match="non-positive"):
            CostModel.from_json(data)
    data = model.to_json()
    data["rates"]["load"]["copy"] = {}
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_json(data)
    data = model.to_json()
    del data["rates"]["backup"]["device_pass"]
    with pytest.raises(KeyError):
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


def test_calibration_is_on_unless_turned_off_and_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.delenv("KVTIER_CALIBRATION", raising=False)
    assert calibrate.enabled()
    for off in ("off", "0", "False", "no"):
        monkeypatch.setenv("KVTIER_CALIBRATION", off)
        assert not calibrate.enabled()
    monkeypatch.setenv("KVTIER_CALIBRATION", "on")
    assert calibrate.enabled()
    assert calibrate.model_for(torch.device("cpu"), [132]) is None


def test_one_process_at_a_time_calibrates_a_machine(tmp_path) -> None:
    """The cache file's lock is exclusive across open files (as across processes) while it is held."""
    path = tmp_path / "calibration" / "gpu.json"
    lock = path.with_suffix(".lock")
    with calibrate.machine_lock(path), open(lock, "a") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
        fcntl.flock(other, fcntl.LOCK_UN)


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
    fast, slow = {1 << 10: 60.0, 1 << 20: 60.0}, {1 << 10: 1.0, 1 << 20: 2.0}

    def measured(staged_indexer: dict[int, float]) -> Rates:
        """48-byte kv rows: kernel 20 GB/s, staging 60 from 1 KiB; 132-byte indexer rows: kernel 20,
        units 50, staging as given."""
        return Rates(
            fast,
            device_pass={48: 1800.0, 132: 1800.0},
            kernel_rows={48: 20.0, 132: 20.0},
            kernel_units={48: 21.0, 132: 50.0},
            staged={48: fast, 132: staged_indexer},
        )

    both = measured(fast)
    model = CostModel("calibrated test", {d: both for d in Direction})
    assert Choice.of(both, 48, "m").staged_min_bytes < 32 * 48
    # The planner's floor (`PathCosts.copy_min_bytes`, 64 KiB) keeps these short host runs off the copy
    # engine: both buffers' go through staging by the kernel's units, which beat its single rows.
    plan = Planner(host, dev, use_kernel=True, model=model).plan(direction, hs, ds)
    assert plan.cost_model == "calibrated test"
    assert plan.mechanisms_by_buffer() == {"kv": {"staged_kernel": 128}, "indexer": {"staged_kernel": 128}}
    # Under a floor of 1 KiB the model's own choice: staging at 60 GB/s, both buffers by the copy engine.
    low = PathCosts(copy_min_bytes=1 << 10)
    plan = Planner(host, dev, low, use_kernel=True, model=model).plan(direction, hs, ds)
    by = plan.mechanisms_by_buffer()
    assert by["kv"] == {"staged": 128} and by["indexer"] == {"staged": 128}
    # Now staging the indexer's rows by the copy engine is slow: they go through the kernel's units.
    slow_model = measured(slow)
    assert Choice.of(slow_model, 132, "m").kernel_staged_below > 32 * 132
    model = CostModel("calibrated slow", {d: slow_model for d in Direction})
    plan = Planner(host, dev, low, use_kernel=True, model=model).plan(direction, hs, ds)
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", list(Direction))
def test_on_a_gpu_the_planner_calibrates_at_first_use_and_moves_rows_byte_for_byte(
    direction, gen, tmp_path, monkeypatch
) -> None:
    """With calibration on (the default), a planner given no model measures this GPU once, caches it in
    the user cache, and plans on it; its plan of host runs of mixed lengths onto scattered device slots
    moves every row exactly, on a side stream."""
    monkeypatch.setenv("KVTIER_CALIBRATION", "on")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    calibrate._model_for.cache_clear()
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 8192), DevicePool(spec, 8192, "cuda", staging_tokens=1000)
    stream = torch.cuda.Stream()
    # Runs of 512 slots, every other one, with a fifth of their slots dropped: runs of 1 to ~100.
    runs = (torch.arange(0, 16, 2)[:, None] * 512 + torch.arange(512)).flatten()
    hs = runs[torch.rand(runs.numel(), generator=gen) > 0.2]
    ds = torch.randperm(8192, generator=gen)[: hs.numel()]
    poison_host(host, gen)
    poison_device(dev, gen)
    plan = Planner(host, dev).plan(direction, hs, ds, stream=stream)
    assert plan.cost_model.startswith("calibrated ")
    model = calibrate.read(calibrate.cache_file(dev.device))
    assert model is not None
    assert all(model.rates[d].knows(b.row_bytes) for d in Direction for b in spec.buffers)
    run_and_check(plan, host, dev, hs, ds, stream)
    calibrate._model_for.cache_clear()


def test_kvtier_calibrate_shows_the_rates_and_the_floored_choices_of_a_model() -> None:
    """The command's tables from a model: every measured row size, and the choices as a planner with
    the default thresholds makes them (the copy engine floored at 64 KiB)."""
    from rich.console import Console

    from kvtier.transfer import calibrate_command

    model = CostModel("calibrated x", {d: rates(28.0, 47.0) for d in Direction})
    choice = calibrate_command._choice(model, 132, Direction.LOAD, 132)
    assert choice["copy_min_bytes"] == 64 << 10  # the floor: the curve alone says ~56 KiB
    assert choice["staged_min_bytes"] == choice["kernel_staged_below"] > 64 << 10
    wide = CostModel("calibrated y", {d: rates(50.0, 50.3, row_bytes=1152) for d in Direction})
    backup = calibrate_command._choice(wide, 1152, Direction.BACKUP, 1152)
    assert backup["staged_min_bytes"] == PathCosts().backup_staged_floor_bytes  # the backups' floor
    assert calibrate_command._choice(model, 1152, Direction.LOAD, 1152) == {}  # a size it did not measure
    console = Console(width=200, record=True)
    console.print(calibrate_command._rates_table(model, [132]))
    console.print(calibrate_command._choices_table({"tiny": {"indexer": {"load": choice}}}))
    text = console.export_text()
    assert "1800" in text and "47.0" in text and "65,536" in text
