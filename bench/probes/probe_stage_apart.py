"""Staged parts with each buffer apart in the staging buffer (`parts.STAGE_APART`), window by window,
the device passes on the pass stream beside another buffer's copies, against the same transfers with
the buffers one after the other from the staging buffer's start, alternating on one lease.

Why: the profile of `glm-5`'s staged layer (`probe_staged_profile.py`) shows its copies at the line
rate and its two device passes (95 + 25 us of a ~3.2 ms layer) one after the other with them: the
latent's pass could run while the indexer's rows arrive (loads), the latent's gather while the
indexer's rows are copied out (backups).

Per spec and direction (DIRECTIONS, default load,backup; one layer of 131072 tokens, the planner's
plans, device slots scattered), ROUNDS rounds of both settings over the host sets, each plan
byte-checked and timed as `kvtier bench transfer` times it. Then one profiled layer of `glm-5` per
direction from contiguous host slots with the buffers apart: its GPU events in order. One JSON line
per row appended to OUT.
Usage: python3 bench/probes/probe_stage_apart.py OUT [SPEC ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier.bench import transfer as bench
from kvtier.pool.device import Direction
from kvtier.pool.host import HostLayout
from kvtier.spec import preset
from kvtier.transfer import TransferPlan, parts

SPECS = ["glm-5"]
HOST_SETS = ("contiguous", "runs-256", "runs-64", "contiguous-churn", "first_fit-churn")
ROUNDS = 2


def plan_of(s: bench.Setup, direction: Direction, host_label: str) -> TransferPlan:
    hs, ds = s.host_sets[host_label], s.dev_sets["scattered"]
    return TransferPlan.build(direction, s.host, s.dev, hs, ds, kernel=s.cfg.kernel, stream=s.stream)


def timeline(s: bench.Setup, direction: Direction) -> list:
    """The GPU events of one profiled layer of the contiguous set, in order: `[start_us, dur_us, name]`."""
    op = bench.plan_op(plan_of(s, direction, "contiguous"), s.host, s.dev, s.stream)
    op()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        op()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    events = sorted(
        (e["ts"], e["dur"], e.get("name", "")[:40], e.get("tid"))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    )
    t0 = events[0][0] if events else 0
    return [[round(t - t0, 1), round(d, 1), n, r] for t, d, n, r in events]


def main() -> None:
    out_path, specs = sys.argv[1], sys.argv[2:] or SPECS
    directions = [Direction(d) for d in os.environ.get("DIRECTIONS", "load,backup").split(",")]
    with open(out_path, "a") as out:
        for spec in specs:
            cfg = bench.BenchConfig(
                spec=preset(spec).with_layers(1),
                tokens=131072,
                layout=HostLayout.LAYER_FIRST,
                device=torch.device("cuda"),
                repeats=10,
                warmup=2,
                cycles=8,
                host_sets=HOST_SETS,
                device_sets=("scattered",),
                variants=("planned",),
                directions=tuple(directions),
            )
            s = bench.setup(cfg, print)
            for direction in directions:
                for r in range(ROUNDS):
                    for apart in (True, False):
                        parts.STAGE_APART = apart
                        for label in HOST_SETS:
                            plan = plan_of(s, direction, label)
                            row = bench._time(s, plan, "planned", plan, label, "scattered")
                            line = {"spec": spec, "direction": direction.value, "round": r, "apart": apart}
                            line |= {"host": label, "path": row.path}
                            line |= {"ratio": row.ceiling_ratio, "gbps": row.gbps, "ok": row.identical}
                            staged = [p for p in plan.parts if isinstance(p, parts.StagedPart)]
                            line |= {
                                "windows": [len(p.windows) for p in staged],
                                "mechanisms": row.mechanisms,
                            }
                            out.write(json.dumps(line) + "\n")
                            print(json.dumps(line), flush=True)
                parts.STAGE_APART = True
                if spec == "glm-5":
                    line = {"spec": spec, "direction": direction.value, "profile": "contiguous, apart"}
                    line["events"] = timeline(s, direction)
                    out.write(json.dumps(line) + "\n")
                    print(json.dumps(line)[:3000], flush=True)
            del s
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
