"""Which step of a cold match + load_back (after evict and synchronize) takes the time."""

import functools
import time
from collections import defaultdict

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController
from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostPool
from kvtier.spec import preset
from kvtier.transfer import plan as plan_mod

acc = defaultdict(list)


def wrap(obj, name, label):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def inner(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label].append((time.perf_counter() - t0) * 1e6)

    setattr(obj, name, inner)


tokens = 131072
for ps in (1, 16):
    acc.clear()
    spec = preset("deepseek-v3", ps)
    c = CacheController(DevicePool(spec, tokens, "cuda"), HostPool(spec, tokens), CacheConfig())
    seq = np.random.default_rng(0).integers(1, 50000, tokens)
    c.insert(seq, c.alloc_device(tokens))
    wrap(c, "match", "match")
    wrap(c, "poll", "poll")
    wrap(c, "_alloc_device", "alloc")
    wrap(c, "_transfer", "transfer(build+jobs)")
    wrap(plan_mod.TransferPlan, "build", "build") if False else None
    wrap(c.load_lane, "run_each", "run_each")
    wrap(c, "_after_compute", "after_compute")
    wrap(c, "_layer_jobs", "layer_jobs")
    wrap(c.tree, "lock_path", "lock_path")
    totals = []
    for _ in range(8):
        c.flush()
        c.evict_device(tokens)
        torch.cuda.synchronize()
        q = seq.copy()
        t0 = time.perf_counter()
        h = c.load_back(c.match(q))
        totals.append((time.perf_counter() - t0) * 1e6)
        h.wait()
    med = {k: round(float(np.median(v[-6:])), 1) for k, v in acc.items()}
    print(f"page {ps}: total {round(float(np.median(totals[2:])), 1)} us;", med, flush=True)
    del c, h
    torch.cuda.empty_cache()
