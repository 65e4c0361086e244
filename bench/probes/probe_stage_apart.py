"""Staged parts with each buffer apart in the staging buffer (`staging.STAGE_APART`), window by window,
the device passes on the pass stream beside another buffer's copies, against the same transfers with
the buffers one after the other from the staging buffer's start, alternating on one lease.

Why: the profile of `glm-5`'s staged layer (`probe_staged_profile.py`) shows its copies at the line
rate and its two device passes (95 + 25 us of a ~3.2 ms layer) one after the other with them: the
latent's pass could run while the indexer's rows arrive (loads), the latent's gather while the
indexer's rows are copied out (backups).

Per spec and direction (DIRECTIONS, default load,backup; one layer of 131072 tokens, the planner's
plans, device slots scattered), ROUNDS rounds of both settings over the host sets, each plan
byte-checked and timed as `kvtier bench transfer` times it (ROUNDS=0: none). Then per direction a
profiled layer of each of PROFILE_SETS (default contiguous) in both settings: the host's issuing
time against the GPU's, the kernels in order, each stream's copies. One JSON line per row appended
to OUT.
Usage: python3 bench/probes/probe_stage_apart.py OUT [SPEC ...]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from probe_common import one_layer
from torch.profiler import ProfilerActivity, profile

from kvtier.bench import transfer as bench
from kvtier.pool.device import Direction
from kvtier.transfer import TransferPlan, parts, staging

SPECS = ["glm-5"]
HOST_SETS = ("contiguous", "runs-256", "runs-64", "contiguous-churn", "first_fit-churn")
ROUNDS = int(os.environ.get("ROUNDS", "2"))
# What the A/B switches: `staging.STAGE_APART` (default) or `staging.SMALL_FIRST` (TOGGLE=small_first).
TOGGLE = "SMALL_FIRST" if os.environ.get("TOGGLE") == "small_first" else "STAGE_APART"
HOST_SETS = tuple(os.environ.get("HOST_SETS", ",".join(HOST_SETS)).split(","))
# Host sets profiled per direction, both settings.
PROFILE_SETS = [x for x in os.environ.get("PROFILE_SETS", "contiguous").split(",") if x]


def plan_of(s: bench.Setup, direction: Direction, host_label: str) -> TransferPlan:
    hs, ds = s.host_sets[host_label], s.dev_sets["scattered"]
    return TransferPlan.build(direction, s.host, s.dev, hs, ds, kernel=s.cfg.kernel, stream=s.stream)


def timeline(s: bench.Setup, direction: Direction, host_label: str) -> dict:
    """One profiled layer of `host_label`: the host's time to issue it (median of 5, no wait) against
    its GPU time, its kernels in order (`[start_us, dur_us, name, stream]`) and, per stream, its
    copies (count, first start, last end, busy us)."""
    op = bench.plan_op(plan_of(s, direction, host_label), s.host, s.dev, s.stream)
    op()
    torch.cuda.synchronize()
    issue, gpu = [], []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s.stream)
        t0 = time.perf_counter()
        op()
        issue.append((time.perf_counter() - t0) * 1e6)
        end.record(s.stream)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
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
    kernels = [[round(t - t0, 1), round(d, 1), n, r] for t, d, n, r in events if not n.startswith("Memcpy")]
    copies: dict[str, list[float]] = {}
    for t, d, n, r in events:
        if n.startswith("Memcpy"):
            c = copies.setdefault(str(r), [0, t - t0, 0.0, 0.0])
            c[0] += 1
            c[2] = max(c[2], t - t0 + d)
            c[3] += d
    copies = {k: [v[0], round(v[1], 1), round(v[2], 1), round(v[3], 1)] for k, v in copies.items()}
    median = lambda xs: round(sorted(xs)[len(xs) // 2], 1)  # noqa: E731
    return {"issue_us": median(issue), "gpu_us": median(gpu), "kernels": kernels, "copies": copies}


def main() -> None:
    out_path, specs = sys.argv[1], sys.argv[2:] or SPECS
    directions = [Direction(d) for d in os.environ.get("DIRECTIONS", "load,backup").split(",")]
    with open(out_path, "a") as out:
        for spec in specs:
            cfg = one_layer(
                spec, HOST_SETS, ("scattered",), variants=("planned",), directions=tuple(directions)
            )
            s = bench.setup(cfg, print)
            for direction in directions:
                for r in range(ROUNDS):
                    for apart in (True, False):
                        setattr(staging, TOGGLE, apart)
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
                for label, apart in itertools.product(PROFILE_SETS, (True, False)):
                    setattr(staging, TOGGLE, apart)
                    line = {"spec": spec, "direction": direction.value, "profile": label, "apart": apart}
                    line |= timeline(s, direction, label)
                    out.write(json.dumps(line) + "\n")
                    print(json.dumps(line)[:3000], flush=True)
                setattr(staging, TOGGLE, True)
            del s
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
