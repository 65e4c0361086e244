"""`kvtier bench transfer` on the CPU: its byte check, and calls that move several layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.bench import transfer
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


def test_forced_stacks_are_timed_and_checked_in_page_first_only() -> None:
    """The `stacked` variant on every layer of `page_first` calls, through a small staging buffer
    (windows of a few pages), byte-checked; `layer_first` leaves it out."""
    cfg = _config(3, variants=("stacked",), host_sets=("contiguous", "runs-1"), staging_tokens=8)
    rows, meta = transfer.run(cfg)
    assert meta["staging_tokens"] == 8
    assert rows and all(r.path == "stacked" and r.identical for r in rows)
    rows, _ = transfer.run(dataclasses.replace(cfg, layout=HostLayout.LAYER_FIRST))
    assert rows == []


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
