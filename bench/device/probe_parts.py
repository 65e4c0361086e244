"""Wall time of each step of match + load_back for a 131072-token deepseek-v3 prefix (page 1 and 16)."""

import time

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.spec import preset
from kvtier.transfer.copy import layer_copies
from kvtier.transfer.plan import TransferPlan


def timed(fn, k=10):
    fn()
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return round(float(np.median(out)), 1)


TOKENS = 131072


def measure(ps: int) -> None:
    tokens = TOKENS
    spec = preset("deepseek-v3", ps)
    c = CacheController(DevicePool(spec, tokens, "cuda"), HostPool(spec, tokens), CacheConfig())
    seq = np.random.default_rng(0).integers(1, 50000, tokens)
    c.insert(seq, c.alloc_device(tokens))
    c.flush()
    c.evict_device(tokens)
    q = seq.copy()
    res = {"match": timed(lambda: c.match(q))}
    m = c.match(q)
    hs = m.host_nodes[0].host_slots
    ds = torch.arange(tokens)

    def build():
        return TransferPlan.build(
            Direction.LOAD,
            c.host_pool,
            c.device_pool,
            hs,
            ds,
            stream=c.load_lane.stream,
            trusted=True,
            whole_pages=True,
        )

    res["build"] = timed(build)
    plan = build()
    res["layer_copies"] = timed(lambda: layer_copies(plan, c.host_pool, c.device_pool))
    res["_layer_jobs"] = timed(lambda: c._layer_jobs(plan, c.load_lane.stream))
    jobs = c._layer_jobs(plan, c.load_lane.stream)
    res["run_each(61 jobs)"] = timed(lambda: c.load_lane.run_each(jobs))
    res["jobs only"] = timed(lambda: [j() for j in jobs])
    res["61 events"] = timed(lambda: [c.load_lane._record() for _ in range(61)])
    res["alloc+free dev"] = timed(lambda: c.device_alloc.free(c.device_alloc.alloc(tokens)))
    torch.cuda.synchronize()
    res["after_compute"] = timed(lambda: c._after_compute(c.load_lane))

    def full():
        c.flush()
        c.evict_device(tokens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = c.load_back(c.match(q))
        dt = (time.perf_counter() - t0) * 1e6
        h.wait()
        return dt

    res["full match+load_back"] = round(float(np.median([full() for _ in range(7)])), 1)
    print(f"page {ps}:", res, flush=True)


for page in (1, 16):
    measure(page)
    torch.cuda.empty_cache()
