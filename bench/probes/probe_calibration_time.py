"""Where `kvtier calibrate`'s seconds go: each measurement of `calibrate._Bench` timed by the wall clock
(`kernel_calls`: each kernel shape's first run, from `COMPILE_THREADS` threads (env), which compiles it
or loads it from Triton's disk cache; `rate`: the kernel's timing),
for the six presets' row sizes, or those given (one spec's: what its planner measures at first use).
Run it twice in one call: the second process finds Triton's cache warm.

One JSON line appended to OUT: the total, the pinned scratch's allocation, and the seconds per method.
Usage: python3 bench/probes/probe_calibration_time.py OUT LABEL [ROW_BYTES,...]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections import defaultdict

import torch

from kvtier.transfer import calibrate

calibrate.COMPILE_THREADS = int(os.environ.get("COMPILE_THREADS", calibrate.COMPILE_THREADS))
ROWS = tuple(int(r) for r in sys.argv[3].split(",")) if len(sys.argv) > 3 else (132, 576, 656, 1152, 2048)
spent: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t

    return wrapper


for method in ("__init__", "kernel_calls", "copy_rates", "device_pass", "staged_rates", "rate", "strided"):
    setattr(calibrate._Bench, method, timed(method, getattr(calibrate._Bench, method)))

torch.cuda.init()
torch.empty(1, device="cuda")
t0 = time.perf_counter()
calibrate.calibrate(torch.device("cuda"), ROWS)
total = time.perf_counter() - t0
line = {"label": sys.argv[2], "rows": list(ROWS), "threads": calibrate.COMPILE_THREADS}
line["total_s"] = round(total, 2)
line.update({k: round(v, 2) for k, v in spent.items()})
print(json.dumps(line))
with open(sys.argv[1], "a") as fh:
    fh.write(json.dumps(line) + "\n")
