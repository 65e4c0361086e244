"""Does a reload go faster when the copy engine and the gather kernel share it, at once, on two streams?

One layer of a 131072-token deepseek-v3 prefix, host runs of 256/64/16/1, device contiguous or
scattered. For each split f (share of the runs given to batched DMA on a side stream, the rest to
the kernel on the load stream, both running at once), checks the bytes and times the layer.
"""

import json
import os
import statistics

import torch

from kvtier.bench.transfer import BenchConfig, setup
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.pool.rows import as_words
from kvtier.spec import preset
from kvtier.transfer import TransferPlan, load_layer

out = os.environ.get("OUT", "/tmp/out")
cfg = BenchConfig(
    spec=preset("deepseek-v3"),
    tokens=131072,
    layout=HostLayout.LAYER_FIRST,
    device=torch.device("cuda"),
    repeats=10,
    warmup=2,
    cycles=0,
    host_sets=("runs-256", "runs-64", "runs-16", "runs-1"),
    device_sets=("contiguous", "scattered"),
    directions=(Direction.LOAD,),
)
s = setup(cfg, print)
ceiling = s.ceilings[Direction.LOAD]
side = torch.cuda.Stream()
main = s.stream
names = [b.name for b in cfg.spec.buffers_on(0)]


def run(plans):
    start = torch.cuda.Event()
    start.record(main)
    side.wait_event(start)
    for p, st in plans:
        load_layer(p, s.host, s.dev, 0, st)
    done = torch.cuda.Event()
    done.record(side)
    main.wait_event(done)


def timed(plans, reps=10):
    for _ in range(2):
        run(plans)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(main)
        run(plans)
        b.record(main)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def check(plans, hs, ds):
    for n in names:
        w = as_words(s.dev.layer(n, 0))
        w[ds.cuda()] = ~w[ds.cuda()]
    run(plans)
    torch.cuda.synchronize()
    for n in names:
        want = as_words(s.host.gather(n, 0, hs))
        got = as_words(s.dev.layer(n, 0))[ds.cuda()].cpu()
        if not torch.equal(want, got):
            return False
    return True


rows = []
for hname, hs in s.host_sets.items():
    length = int(hname.removeprefix("runs-"))
    run_id = torch.arange(len(hs)) // length
    for dname, ds in s.dev_sets.items():
        for f in (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0):
            if length == 1 and f > 0.2:
                continue
            dma_mask = (run_id * 7919 % 100) < int(f * 100)
            plans = []
            if dma_mask.any():
                plans.append(
                    (
                        TransferPlan.build(
                            "load",
                            s.host,
                            s.dev,
                            hs[dma_mask],
                            ds[dma_mask],
                            force="batched_dma",
                            stream=main,
                        ),
                        side,
                    )
                )
            if (~dma_mask).any():
                plans.append(
                    (
                        TransferPlan.build(
                            "load", s.host, s.dev, hs[~dma_mask], ds[~dma_mask], force="kernel", stream=main
                        ),
                        main,
                    )
                )
            torch.cuda.synchronize()
            ok = check(plans, hs, ds)
            sec = timed(plans)
            gbps = s.layer_bytes / sec / 1e9
            row = dict(
                host=hname,
                device=dname,
                dma_share=f,
                gbps=round(gbps, 1),
                of_ceiling=round(gbps / ceiling, 3),
                identical=ok,
            )
            rows.append(row)
            print(row, flush=True)
with open(f"{out}/probe_split.json", "w") as fh:
    json.dump({"ceiling_gbps": ceiling, "rows": rows}, fh, indent=1)
