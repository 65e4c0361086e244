"""What the layer probes share: one layer of a spec as `kvtier bench transfer` builds it, and a plan
timed as it times one (byte-checked first, destinations poisoned).

Imported by its siblings (`python3 bench/probes/probe_*.py` puts this folder on the path).
"""

from __future__ import annotations

import json
from typing import TextIO

import torch

from kvtier.bench.transfer import BenchConfig, Setup, check_plan, plan_op
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import TransferPlan


def one_layer(spec: str, host_sets: tuple[str, ...], device_sets: tuple[str, ...], **extra) -> BenchConfig:
    """One `layer_first` layer of 131072 tokens of preset `spec` on the GPU, 10 repeats after 2 warmups,
    8 churn cycles (`extra`: other `BenchConfig` fields)."""
    return BenchConfig(
        spec=preset(spec, 1).with_layers(1),
        tokens=131072,
        layout=HostLayout.LAYER_FIRST,
        device=torch.device("cuda"),
        repeats=10,
        warmup=2,
        cycles=8,
        host_sets=host_sets,
        device_sets=device_sets,
        **extra,
    )


def timed(s: Setup, plan: TransferPlan, direction: Direction) -> tuple[float, bool]:
    """`plan`'s GB/s over the same run's ceiling in `direction` (median of 10 x 4 calls), and whether
    it moved every row byte for byte (checked first)."""
    ok = check_plan(s, plan)
    ms = s.timer.median_ms(plan_op(plan, s.host, s.dev, s.stream), 10, 2, 4)
    return round(s.layer_bytes / ms / 1e6 / s.ceilings[direction], 3), ok


def emit(out: TextIO, row: dict) -> None:
    """`row` as one JSON line, printed and appended to `out` (flushed: a run cut short keeps its rows)."""
    print(json.dumps(row), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()
