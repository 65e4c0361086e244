"""Whether an overlapped plan gains when its split between staging by the copy engine and the kernel is
moved towards the kernel: the calibrated model's staging threshold of the widest rows (rows of 256 B or
more) scaled by `FACTORS`, everything else as planned (riders follow the widest buffer's threshold).
With `--riders`, instead: the plan as the planner makes it against the same plan with no buffer
riding (`splits`; the factor column then says 1 riding, 0 not).

Overlapped (`execute.phases`), a layer's time is the longer of its two streams: after first-fit churn
onto scattered slots the copy engine's stream carries most rows, the kernel's stream idles after
a third of the layer. Per spec and direction, per factor: the plan's rows by mechanism, GB/s over
the same run's ceiling, overlapped and serial, each byte-checked first (destinations poisoned).

One JSON line per row appended to OUT. Usage: python3 bench/probes/probe_balance.py OUT [--riders] [SPEC ...]
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from probe_common import emit, one_layer, timed

from kvtier.bench.transfer import setup
from kvtier.pool.device import Direction
from kvtier.transfer import Planner, calibrate, costs, splits
from kvtier.transfer.options import KernelOptions

FACTORS = (1.0, 1.5, 2.0, 3.0, 5.0, 1e6)
SETS = ("first_fit-churn", "contiguous-churn", "runs-256")
factor = 1.0
_choice = costs.CostModel.choice


def scaled_choice(self, row_bytes, direction, least=0.0):
    c = _choice(self, row_bytes, direction, least)
    if c is None or row_bytes < costs.SMALL_ROW_BYTES:
        return c
    return dataclasses.replace(c, staged_min_bytes=c.staged_min_bytes * factor)


costs.CostModel.choice = scaled_choice
_split_all = splits.split_all


def split_all(groups, found, n, min_average, *share):
    """`splits.split_all`, riding only where `factor` is 1 (0: no buffer rides)."""
    return _split_all(groups, found, n, min_average if factor else float("inf"), *share)


def main() -> None:
    global factor
    global FACTORS
    out = open(sys.argv[1], "a")  # noqa: SIM115
    names = sys.argv[2:]
    if names[:1] == ["--riders"]:
        names = names[1:]
        FACTORS = (1, 0)
        splits.split_all = split_all
        costs.CostModel.choice = _choice
    for name in names or ["glm-5", "deepseek-v3"]:
        cfg = one_layer(name, SETS, ("scattered",))
        s = setup(cfg, lambda _m: None)
        model = calibrate.model_for(s.dev.device, [b.row_bytes for b in cfg.spec.buffers])
        for direction in Direction:
            for host_label in SETS:
                for factor in FACTORS:
                    for overlap in (True, False):
                        planner = Planner(s.host, s.dev, kernel=KernelOptions(overlap=overlap), model=model)
                        plan = planner.plan(direction, s.host_sets[host_label], s.dev_sets["scattered"])
                        ratio, ok = timed(s, plan, direction)
                        row = {
                            "spec": name,
                            "direction": direction.value,
                            "host_runs": host_label,
                            "factor": factor,
                            "overlap": overlap,
                            "mechanisms": plan.mechanisms_by_buffer(),
                            "sms": plan.sms_used,
                            "ceiling_ratio": ratio,
                            "identical": ok,
                        }
                        emit(out, row)
        del s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
