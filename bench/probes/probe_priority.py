"""Probe: does the load stream's priority or the kernel's SM budget change the matmul's loss?

The overlap bench measured a bf16 8192^3 matmul loop keeping 0.88-0.91 of its rate beside
a gather-kernel reload on 8 SMs, and the reload itself at 0.74-0.77 of the ceiling (its
programs wait for SMs that matmul blocks hold). An SM-bound matmul that fills all 132 SMs
cannot keep more than 124/132 = 0.94 while 8 SMs copy. Here: the same interference
measurement (`bench.overlap._interference`, alternated rounds, medians) for load streams
of default and high priority and budgets of 4, 8 and 16 programs. One JSON line per case.

Run on the device: python3 bench/probes/probe_priority.py > $OUT/priority.jsonl
"""

from __future__ import annotations

import dataclasses
import json

import torch

from kvtier.bench.overlap import _interference
from kvtier.bench.transfer import BenchConfig, setup
from kvtier.pool import HostLayout
from kvtier.spec import preset
from kvtier.transfer import KernelOptions, TransferPlan


def main() -> None:
    tokens = 131072
    cfg = BenchConfig(
        spec=preset("deepseek-v3").with_layers(1),
        tokens=tokens,
        layout=HostLayout.LAYER_FIRST,
        device=torch.device("cuda"),
        repeats=10,
        warmup=2,
        cycles=0,
        host_sets=("contiguous",),
        device_sets=("contiguous",),
    )
    s = setup(cfg, lambda _m: None)
    gen = torch.Generator().manual_seed(5)
    hs = torch.randperm(s.host.num_slots, generator=gen)[:tokens]
    ds = torch.randperm(s.dev.num_slots, generator=gen)[:tokens]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(json.dumps({"sms": sms, "priorities": list(torch.cuda.Stream.priority_range())}))
    for priority in (0, -1):
        for sm in (4, 8, 16):
            stream = torch.cuda.Stream(priority=priority)
            plan = TransferPlan.build(
                "load", s.host, s.dev, hs, ds, force="kernel", kernel=KernelOptions(sm), stream=stream
            )
            alone, beside, reload = _interference(dataclasses.replace(s, stream=stream), plan, rounds=7)
            ceiling = s.ceilings[plan.direction]
            print(
                json.dumps(
                    {
                        "priority": priority,
                        "sm_budget": sm,
                        "matmul_alone_tflops": round(alone, 1),
                        "matmul_beside_tflops": round(beside, 1),
                        "matmul_kept": round(beside / alone, 3),
                        "reload_gbps": round(reload, 2),
                        "reload_of_ceiling": round(reload / ceiling, 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
