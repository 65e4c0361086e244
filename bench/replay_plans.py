"""Replay on the CPU what the planner would choose on the GPU: each set of a `calibrated.sh` A/B file
planned again on its spec's bench pools (the same seed, tokens and churn), with the thresholds and
with a calibration file's model (floored as the planner floors it), beside the mechanisms and
ceiling ratios the GPU measured for each model.

A replayed plan whose mechanisms equal a measured one's runs as that one ran (the plan is decided
on CPU indices alone; the GPU only times it), so a model change can be judged on the sets whose
mechanisms it changes without a GPU; the rest need a run.

Usage (CPU, the Triton interpreter for the kernel's planning of a GPU run's sets):
  TRITON_INTERPRET=1 python bench/replay_plans.py AB.json CALIBRATION.json [SPEC ...]
"""

from __future__ import annotations

import json
import sys

import torch

from kvtier.bench.transfer import BenchConfig, setup
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import Planner
from kvtier.transfer.costs import CostModel


def replay(ab: dict, model: CostModel, spec_name: str) -> list[dict]:
    runs = {m: ab[f"cal_{spec_name}_{m}"] for m in ("defaults", "calibrated")}
    meta = runs["defaults"]["meta"]
    measured = {
        m: {(r["direction"], r["host_runs"], r["device"]): r for r in run["rows"]} for m, run in runs.items()
    }
    cfg = BenchConfig(
        spec=preset(spec_name, meta["page_size"]).with_layers(meta["layers"]),
        tokens=meta["tokens"],
        layout=meta["layout"],
        device=torch.device("cpu"),
        repeats=1,
        warmup=0,
        cycles=meta["churn_cycles"],
        host_sets=tuple(dict.fromkeys(r["host_runs"] for r in runs["defaults"]["rows"])),
        staging_tokens=meta["staging_tokens"],
    )
    s = setup(cfg, lambda _msg: None)
    kernel = meta["device"].startswith("cuda")  # the bench's planner had the kernel on a GPU only
    planners = {
        "defaults": Planner(s.host, s.dev, use_kernel=kernel),
        "floored": Planner(s.host, s.dev, use_kernel=kernel, model=model),
    }
    out = []
    for key, row in measured["defaults"].items():
        d, host_label, dev_label = key
        hs, ds = s.host_sets[host_label], s.dev_sets[dev_label]
        got = {name: p.plan(Direction(d), hs, ds).mechanisms_by_buffer() for name, p in planners.items()}
        same_as = [m for m in ("defaults", "calibrated") if measured[m][key]["mechanisms"] == got["floored"]]
        out.append(
            {
                "spec": spec_name,
                "direction": d,
                "host_runs": host_label,
                "device": dev_label,
                "defaults": row["ceiling_ratio"],
                "calibrated": measured["calibrated"][key]["ceiling_ratio"],
                "replayed_defaults_match": got["defaults"] == row["mechanisms"],
                "floored_runs_as": same_as,
                "floored": got["floored"],
            }
        )
    return out


def main() -> None:
    with open(sys.argv[1]) as fh:
        ab = json.load(fh)
    with open(sys.argv[2]) as fh:
        model = CostModel.from_json(json.load(fh)["model"])
    specs = sys.argv[3:] or sorted({k.split("_")[1] for k in ab})
    for spec_name in specs:
        for r in replay(ab, model, spec_name):
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
