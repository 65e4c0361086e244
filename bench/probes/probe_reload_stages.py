"""The CPU time of a cold `match` + `load_back` of 131072 tokens, by stage, for two submission forms.

As `kvtier bench cache --parts reload` (61 layers of deepseek-v3, int32 ids, the prefix evicted to
the host and the cache flushed before each call), at page sizes 1 and 16, alternating per repeat:
- `layers`: the addresses computed in the compiled loop from the joint runs (`copy.run_layers`);
- `table`: the numpy table of every layer's rows, run by the tape loop (`copy.copy_table`).
(Call 2 also had `layers_spun`: the thread busy for 20 ms before the call; it was no faster.)
Prints per form the median wall time of match + load_back (no wrappers), then, in a second pass
with perf_counter wrappers, the median time of each stage; and the loop call alone (the driver's
share: 61 copies and 62 records, the wait). Writes JSON lines to argv[1]. (Calls 1-3 timed
`_transfer`, the plan and its submission, since split into `_plan` and `_submit`.)
"""

import functools
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController, streams
from kvtier.cache import controller as ctl
from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostPool
from kvtier.spec import preset
from kvtier.transfer import native
from kvtier.transfer.plan import Planner

rows: list[dict] = []
tokens, reps = 131072, 14
FORMS = ("layers", "table")
stages: dict[str, float] = {}


def timed(owner, name: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, g)


def one(c: CacheController, seq: np.ndarray, form: str) -> tuple[float, float]:
    c.flush()
    c.evict_device(tokens)
    torch.cuda.synchronize()
    q = seq.copy()
    if form == "table":
        c._copy_runs = lambda *a, **k: None
    else:
        c.__dict__.pop("_copy_runs", None)
    stages.clear()
    w0, c0 = time.perf_counter(), time.process_time()
    h = c.load_back(c.match(q))
    w1, c1 = time.perf_counter(), time.process_time()
    h.wait()
    assert h.tokens == tokens
    return (w1 - w0) * 1e6, (c1 - c0) * 1e6


for ps in (1, 16):
    spec = preset("deepseek-v3", ps)
    c = CacheController(DevicePool(spec, tokens, "cuda"), HostPool(spec, tokens), CacheConfig())
    seq = np.random.default_rng(0).integers(1, 50000, tokens).astype(np.int32)
    c.insert(seq, c.alloc_device(tokens))
    res: dict[str, dict] = {}
    for form in FORMS:
        res[form] = {"wall_us": [], "cpu_us": []}
    for i in range(2 * reps):
        form = FORMS[i % 2]
        w, p = one(c, seq, form)
        if i >= 6:
            res[form]["wall_us"].append(w)
            res[form]["cpu_us"].append(p)
    # Second pass: stage times (the wrappers add ~1 us per wrapped call).
    timed(ctl.CacheController, "match")
    timed(ctl.CacheController, "_alloc_device")
    timed(ctl.CacheController, "_copy_runs")
    timed(ctl.CacheController, "_submit")
    timed(streams.CudaLane, "run_native")
    timed(native.Native, "run_layers")
    timed(native.Tape, "run")
    timed(ctl.CacheController, "load_back")
    timed(Planner, "copies")
    timed(ctl.CacheController, "_plan")
    per: dict[str, list[dict]] = {f: [] for f in FORMS}
    for i in range(2 * reps):
        form = FORMS[i % 2]
        one(c, seq, form)
        if i >= 6:
            per[form].append(dict(stages))
    for form in FORMS:
        r = res[form]
        keys = sorted({k for s in per[form] for k in s})
        st = {k: round(statistics.median(s.get(k, 0.0) for s in per[form]) * 1e6, 1) for k in keys}
        row = {
            "page_size": ps,
            "form": form,
            "wall_us": round(statistics.median(r["wall_us"]), 1),
            "cpu_us": round(statistics.median(r["cpu_us"]), 1),
            "wall_us_min": round(min(r["wall_us"]), 1),
            "wall_us_max": round(max(r["wall_us"]), 1),
            "stages_us": st,
        }
        print(json.dumps(row))
        rows.append(row)
    # restore for the next page size
    for owner, name in (
        (ctl.CacheController, "match"),
        (ctl.CacheController, "_alloc_device"),
        (ctl.CacheController, "_copy_runs"),
        (ctl.CacheController, "_submit"),
        (streams.CudaLane, "run_native"),
        (native.Native, "run_layers"),
        (native.Tape, "run"),
        (ctl.CacheController, "load_back"),
        (Planner, "copies"),
        (ctl.CacheController, "_plan"),
    ):
        setattr(owner, name, getattr(owner, name).__wrapped__)
    del c
    torch.cuda.empty_cache()
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
