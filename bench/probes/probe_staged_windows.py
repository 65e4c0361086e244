"""How many windows a staged layer should be cut into, now that windows alternate staging halves.

`kvtier bench transfer`'s setup (one layer of TOKENS tokens, its host sets, scattered device
slots, staging of 2 x TOKENS rows so that a half holds the layer), the planner's plan built with
`PathCosts(staged_windows=K)` for each K (and the minimum window bytes MIN_MB), checked byte for
byte and timed as the bench times (4 calls behind a GPU sleep, median of 5). K = 1 is the
executor before halves: one window, the device side after it. Prints one JSON line per (spec,
direction, set, K) and appends it to OUT.

It ran (2026-12-01) against an experimental executor that was measured and not kept: staged
windows alternating between two halves of the staging buffer, the device side on a second stream,
sized by `PathCosts.staged_windows` and `staged_window_min_bytes` (bench/FINDINGS.md, dead ends).
Today's library has neither field; the probe records the method.

Usage: python3 bench/probes/probe_staged_windows.py OUT.jsonl SPECS [KS=1,2,4,8] [TOKENS=131072] [MIN_MB=4]
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kvtier.bench import transfer as bench
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import TransferPlan
from kvtier.transfer.options import PathCosts

SETS = ("contiguous", "runs-256", "runs-64", "runs-16", "contiguous-churn", "first_fit-churn")


def main() -> None:
    out = open(sys.argv[1], "a")  # noqa: SIM115 - the whole probe's log
    specs = sys.argv[2].split(",")
    ks = [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8").split(",")]
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 131072
    min_bytes = int(float(sys.argv[5]) * (1 << 20)) if len(sys.argv) > 5 else 4 << 20
    for name in specs:
        cfg = bench.BenchConfig(
            spec=preset(name, 1).with_layers(1),
            tokens=tokens,
            layout=HostLayout.LAYER_FIRST,
            device=torch.device(os.environ.get("DEVICE", "cuda")),
            repeats=5,
            warmup=2,
            cycles=8,
            host_sets=SETS,
            device_sets=("scattered",),
            staging_tokens=2 * tokens,
        )
        s = bench.setup(cfg, lambda msg: None)
        for direction in (Direction.LOAD, Direction.BACKUP):
            for label, hs in s.host_sets.items():
                for k in ks:
                    costs = PathCosts(staged_windows=k, staged_window_min_bytes=min_bytes)
                    plan = TransferPlan.build(
                        direction, s.host, s.dev, hs, s.dev_sets["scattered"], costs=costs, stream=s.stream
                    )
                    if not any(p.mechanism.value == "staged" for p in plan.parts):
                        break
                    row = bench._time(s, plan, "planned", plan, label, "scattered")
                    windows = max(len(p.windows) for p in plan.parts if p.mechanism.value == "staged")
                    rec = {
                        "spec": name,
                        "direction": direction.value,
                        "host": label,
                        "k": k,
                        "windows": windows,
                        "ratio": row.ceiling_ratio,
                        "gbps": row.gbps,
                        "identical": row.identical,
                        "mechanisms": row.mechanisms,
                        "ceiling": round(s.ceilings[direction], 2),
                    }
                    print(json.dumps(rec), flush=True)
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
        s.host.close()
        s.dev.close()
        del s
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
