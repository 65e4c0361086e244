"""Where the GPU's time goes in `glm-5`'s staged plans onto scattered device slots: one layer of 131072
tokens from contiguous host slots (staged whole, 0.945 of the ceiling against 0.99 for its single
copy) and after first-fit churn (0.916 / 0.918, under the goal), the planner's plans.

Why: the staged copies run at the line rate and the device pass of 168 MB should take ~0.15 ms of a
3.05 ms layer; what else the layer spends (gaps between the copy engine's and the SMs' work, the
indexer's pieces, the kernel parts beside) is not measured.

Per direction and host set: the plan byte-checked as the bench checks it, timed as the bench times it
(4 back-to-back layers behind a GPU sleep), then the same 4 layers under `torch.profiler` (CUDA
activity), whose Chrome trace is written to OUT_DIR (gzip) with a summary line per case in
OUT_DIR/staged_profile.jsonl: per stream, busy time and the copies' and kernels' counts and time.
Usage: python3 bench/probes/probe_staged_profile.py OUT_DIR
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from pathlib import Path

import torch
from probe_common import one_layer
from torch.profiler import ProfilerActivity, profile

from kvtier.bench import transfer as bench
from kvtier.pool.device import Direction
from kvtier.transfer import TransferPlan

CALLS = 4


def summary(trace: dict) -> dict:
    """Per stream: GPU events, their time, and the span from the first start to the last end (us)."""
    by_stream: dict[str, list] = collections.defaultdict(list)
    for e in trace.get("traceEvents", []):
        if "sleep" in e.get("name", ""):
            continue  # the hold before the calls
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_stream[f"{e['cat']}:{e.get('tid')}"].append((e["ts"], e["dur"], e.get("name", "")[:40]))
    out = {}
    first = min((t for evs in by_stream.values() for t, _, _ in evs), default=0)
    last = max((t + d for evs in by_stream.values() for t, d, _ in evs), default=0)
    for key, evs in by_stream.items():
        names = collections.Counter(n for _, _, n in evs)
        out[key] = {
            "events": len(evs),
            "busy_us": round(sum(d for _, d, _ in evs), 1),
            "names": dict(names.most_common(4)),
        }
    return {"span_us": round(last - first, 1), "streams": out}


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = one_layer("glm-5", ("contiguous", "first_fit-churn"), ("scattered",), variants=("planned",))
    s = bench.setup(cfg, print)
    with open(out_dir / "staged_profile.jsonl", "a") as log:
        for direction in (Direction.LOAD, Direction.BACKUP):
            for host_label, hs in s.host_sets.items():
                ds = s.dev_sets["scattered"]
                plan = TransferPlan.build(
                    direction, s.host, s.dev, hs, ds, kernel=cfg.kernel, stream=s.stream, layers_per_call=1
                )
                row = bench._time(s, plan, "planned", plan, host_label, "scattered")
                op = bench.plan_op(plan, s.host, s.dev, s.stream)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    with torch.cuda.stream(s.stream):
                        torch.cuda._sleep(4_000_000)
                    for _ in range(CALLS):
                        op()
                    torch.cuda.synchronize()
                name = f"staged_profile_{direction.value}_{host_label}.json"
                prof.export_chrome_trace(str(out_dir / name))
                raw = (out_dir / name).read_bytes()
                (out_dir / name).unlink()
                (out_dir / (name + ".gz")).write_bytes(gzip.compress(raw))
                trace = json.loads(raw)
                line = {
                    "direction": direction.value,
                    "host": host_label,
                    "ratio": row.ceiling_ratio,
                    "ms": row.ms,
                    "identical": row.identical,
                    "mechanisms": row.mechanisms,
                    "layer_bytes": s.layer_bytes,
                    "ceilings": {d.value: g for d, g in s.ceilings.items()},
                    "calls": CALLS,
                } | summary(trace)
                log.write(json.dumps(line) + "\n")
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
