"""The planner's measured costs (`kvtier.transfer.probe`): the rule that turns shares into costs, and
plans per direction. The timing itself runs on CUDA only (bench/device/transfer.sh records it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import PathCosts, Planner, TransferPath, probe, rule
from kvtier.transfer.options import MeasuredCosts, per_direction

# Shares of the same-run ceiling and the host's seconds to issue a copy, as two H100 hosts gave
# them (bench/FINDINGS.md): the first host's kernel near the fixed rule, its short copies slow and
# its batched call ~13 us beyond the bytes; the second's kernel slow, its copies of 18 KiB runs near
# the link's rate, its call free and its copies issued fast.
CEILING_S = probe.ROWS * probe.ROW_BYTES / 53e9
FIRST_HOST = (0.92, {4608: (0.3, 0.8, 0.6e-6), 18432: (0.7, 0.9, 0.5e-6), 73728: (0.9, 0.92, 0.9e-6)})
SECOND_HOST = (0.61, {4608: (0.45, 0.55, 0.3e-6), 18432: (0.92, 0.6, 0.35e-6), 73728: (1.0, 0.62, 1e-6)})


def test_a_host_the_fixed_rule_fits_keeps_it() -> None:
    base = PathCosts()
    costs, changes = probe.adjust(base, *FIRST_HOST, CEILING_S)
    assert changes == {} and costs == base


def test_a_slow_kernel_and_fast_short_copies_move_the_rule() -> None:
    costs, changes = probe.adjust(PathCosts(), *SECOND_HOST, CEILING_S)
    assert changes["kernel_scale"] == pytest.approx(0.61 / 0.93, abs=1e-3)
    assert changes["copy_min_bytes"] == 18432 and changes["copy_host_s"] == pytest.approx(0.3e-6)
    assert changes["copy_call_s"] == 0.0  # the longest runs' copies at the ceiling: no cost beyond bytes
    assert costs.kernel_rate(16 << 10) == pytest.approx(0.61, abs=1e-3)
    # 512 runs of 16 rows of 1152 bytes (8192 tokens of an MLA layer): the fixed rule gives them all
    # to the kernel, the measured costs all to the copy engine.
    lens = np.full(512, 16, dtype=np.int64)
    assert int(np.argmin(rule.split_times(PathCosts(), lens, 1152, 14))) == 0
    assert int(np.argmin(rule.split_times(costs, lens, 1152, 14))) == 512


def test_the_call_and_the_hosts_copy_cost_follow_the_measurement() -> None:
    """A batched call the longest runs show dear raises `copy_call_s`; a host slow to issue copies
    raises `copy_host_s`, and then 512 short copies no longer beat the kernel."""
    runs = {4608: (0.2, 0.9, 1.2e-6), 18432: (0.5, 0.9, 1e-6), 73728: (0.8, 0.9, 1.5e-6)}
    costs, changes = probe.adjust(PathCosts(), 0.92, runs, CEILING_S)
    call = CEILING_S / 0.8 - CEILING_S - 128 * PathCosts().copy_fixed_s
    assert changes["copy_call_s"] == pytest.approx(call, abs=1e-7) and changes["copy_host_s"] == 1e-6
    lens = np.full(512, 16, dtype=np.int64)
    assert int(np.argmin(rule.split_times(costs, lens, 1152, 14))) == 0
    # Within the margins nothing moves.
    near = {size: (share, kern, 0.55e-6) for size, (share, kern, _) in FIRST_HOST[1].items()}
    assert probe.adjust(PathCosts(), 0.92, near, CEILING_S)[1] == {}


def test_the_measurement_never_raises_the_kernel_or_the_shortest_copy() -> None:
    fast_kernel = (1.0, {4608: (0.2, 0.9, 1e-6), 18432: (0.5, 0.95, 1e-6), 73728: (0.8, 0.97, 1e-6)})
    costs, changes = probe.adjust(PathCosts(), *fast_kernel, CEILING_S)
    assert "kernel_scale" not in changes and "copy_min_bytes" not in changes
    assert costs.kernel_scale == 1.0 and costs.copy_min_bytes == PathCosts().copy_min_bytes
    # Copies that win only at a size the rule already copies change nothing either.
    late = (0.92, {4608: (0.3, 0.9, 1e-6), 18432: (0.6, 0.9, 1e-6), 73728: (0.99, 0.9, 1e-6)})
    assert "copy_min_bytes" not in probe.adjust(PathCosts(), *late, CEILING_S)[1]


def test_a_win_the_longer_runs_contradict_is_not_taken() -> None:
    erratic = (0.9, {4608: (0.9, 0.5, 0.1e-6), 18432: (0.5, 0.9, 1e-6), 73728: (0.99, 0.9, 1e-6)})
    _, changes = probe.adjust(PathCosts(), *erratic, CEILING_S)
    assert "copy_min_bytes" not in changes


def test_plans_follow_each_directions_costs(monkeypatch) -> None:
    """Loads by the measured load costs, backups by the backup costs (the kernel on CPU: interpreted)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = preset("tiny-dsa", 1)
    host, dev = HostPool(spec, 2 * 128 * 384), DevicePool(spec, 128 * 384)
    slow_loads = MeasuredCosts(load=probe.adjust(PathCosts(), *SECOND_HOST, CEILING_S)[0], backup=PathCosts())
    planner = Planner(host, dev, costs=slow_loads, use_kernel=True)
    if not planner.kernel_ok:
        pytest.skip("Triton is not installed")
    rows = 18432 // spec.buffer("kv").row_bytes  # runs of 18 KiB of the latent rows
    runs = 128
    hs = (torch.arange(runs).unsqueeze(1) * 2 * rows + torch.arange(rows)).flatten()
    ds = torch.arange(runs * rows)
    assert planner.plan(Direction.LOAD, hs, ds).path is TransferPath.COPY
    assert planner.plan(Direction.BACKUP, hs, ds).path is TransferPath.KERNEL
    fixed = Planner(host, dev, use_kernel=True)
    assert fixed.plan(Direction.LOAD, hs, ds).path is TransferPath.KERNEL


def test_costs_of_another_type_are_refused() -> None:
    with pytest.raises(ConfigError, match="PathCosts or MeasuredCosts"):
        per_direction({"copy_host_s": 1e-6})
    with pytest.raises(ConfigError, match="kernel_scale"):
        spec = preset("tiny-dsa", 1)
        Planner(HostPool(spec, 64), DevicePool(spec, 64), costs=PathCosts(kernel_scale=1.5))


def test_nothing_is_measured_off_cuda_or_when_turned_off(monkeypatch) -> None:
    assert probe.measured_costs("cpu") is None
    monkeypatch.setenv("KVTIER_MEASURE_COSTS", "0")
    assert not probe.enabled()
    assert probe.measured_costs("cpu") is None


def test_timings_become_shares_host_costs_and_changes(monkeypatch) -> None:
    """The measurement's plumbing on CPU pools (the kernel interpreted), each timing given: a device
    time per path and the host's time to issue the call."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(probe, "ROWS", 64)
    spec = preset("tiny-mla", 1)
    host, dev = HostPool(spec, 128), DevicePool(spec, 64)
    timed = []

    def held(stream, call, repeats, batch, hold_cycles):
        plan = call.args[0]
        timed.append(plan.path)
        device_s = 1e-4 if plan.path is TransferPath.COPY else 2e-4  # the kernel at half the ceiling
        return device_s, 8e-6

    monkeypatch.setattr(probe, "held_times", held)
    no_stream = SimpleNamespace(synchronize=lambda: None)  # CPU pools move as they are called
    costs, evidence = probe._direction(Direction.LOAD, host, dev, no_stream, PathCosts())
    assert timed[:2] == [TransferPath.COPY, TransferPath.KERNEL] and len(timed) == 2 + 2 * len(probe.RUN_ROWS)
    assert evidence["kernel"] == 0.5 and evidence["runs_4608"] == {"copy": 1.0, "kernel": 0.5, "host_us": 0.5}
    assert evidence["changes"]["copy_call_s"] == 0.0 and costs.copy_host_s == pytest.approx(0.5e-6)
    assert costs.kernel_scale == pytest.approx(0.5 / 0.93, abs=1e-3)
