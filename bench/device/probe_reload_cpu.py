"""Where the CPU time of a cold `match` + `load_back` of 131072 tokens goes, per function (cProfile).

As `kvtier bench cache --parts reload` (61 layers of deepseek-v3, int32 ids, evicted to the host
and flushed before each call), at page sizes 1 and 16: the medians of the timed calls, then
the functions by own time per call, in microseconds (cProfile inflates small calls, so
read the shares, not the sums).
"""

import cProfile
import pstats
import time

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController
from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostPool
from kvtier.spec import preset

tokens, reps = 131072, 12
for ps in (1, 16):
    spec = preset("deepseek-v3", ps)
    c = CacheController(DevicePool(spec, tokens, "cuda"), HostPool(spec, tokens), CacheConfig())
    seq = np.random.default_rng(0).integers(1, 50000, tokens).astype(np.int32)
    c.insert(seq, c.alloc_device(tokens))
    plain, prof = [], cProfile.Profile()
    for i in range(2 * reps):
        c.flush()
        c.evict_device(tokens)
        torch.cuda.synchronize()
        q = seq.copy()
        profiled = i >= reps
        if profiled:
            prof.enable()
        t0 = time.perf_counter()
        h = c.load_back(c.match(q))
        t1 = time.perf_counter()
        if profiled:
            prof.disable()
        else:
            plain.append((t1 - t0) * 1e6)
        h.wait()
        del h
    print(f"page {ps}: match + load_back {np.median(plain[2:]):.0f} us (median of {reps - 2}, unprofiled)")
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:28]
    for (file, line, fn), (_cc, nc, tt, ct, _) in rows:
        where = f"{file.split('/')[-1]}:{line}({fn})"
        print(f"  {tt / reps * 1e6:8.1f} own {ct / reps * 1e6:8.1f} cum {nc / reps:7.1f} calls  {where}")
    del c
    torch.cuda.empty_cache()
