"""The matmul beside a copy-engine reload: single copies as cudaMemcpyAsync, or as a
cudaMemcpyBatchAsync of one copy with the PreferOverlapWithCompute hint (`dma._attrs`).

As `kvtier bench overlap`'s interference rows (deepseek-v3 bf16, 131072 tokens per layer
call, 8192^3 bf16 matmuls on the compute stream, rounds of 2 s alternating with rounds
alone after 8 s of matmuls), for the copy-engine plan only, in blocks alternating between
the two forms: plain, hint, plain, hint, ... One JSON line per block (median share of the
matmul's rate kept, reload GB/s), then the medians per form. argv: blocks per form, rounds
per block, output path.
"""

import json
import statistics
import sys

import torch

from kvtier.bench.overlap import _interference
from kvtier.bench.transfer import BenchConfig, setup
from kvtier.pool.device import Direction
from kvtier.pool.host import HostLayout
from kvtier.spec import preset
from kvtier.transfer import TransferPath, TransferPlan, dma

blocks, rounds = int(sys.argv[1]), int(sys.argv[2])
cfg = BenchConfig(
    spec=preset("deepseek-v3", 1).with_layers(1),
    tokens=131072,
    layout=HostLayout.LAYER_FIRST,
    device=torch.device("cuda"),
    repeats=1,
    warmup=1,
    cycles=1,
)
s = setup(cfg, print)
t = torch.arange(cfg.tokens)
load = TransferPlan.build("load", s.host, s.dev, t, t, force=TransferPath.SINGLE_COPY, stream=s.stream)
assert dma.dma_mode() is dma.DmaMode.BATCH and dma._direct_batch() is not None
plain_small = dma.small_batch
print(json.dumps({"ceiling_gbps": round(s.ceilings[Direction.LOAD], 1)}))
out = []
for i in range(2 * blocks):
    form = ("plain", "hint")[i % 2]
    # small_batch 0: even one copy goes out as a batched call, with the hint in its attributes
    dma.small_batch = plain_small if form == "plain" else (lambda: 0)
    alone, beside, gbps, kept = _interference(s, load, rounds)
    row = {"form": form, "block": i // 2, "alone_tflops": round(alone, 1), "beside_tflops": round(beside, 1),
           "kept": round(kept, 4), "reload_gbps": round(gbps, 1)}  # fmt: skip
    print(json.dumps(row), flush=True)
    out.append(row)
for form in ("plain", "hint"):
    kept = [r["kept"] for r in out if r["form"] == form]
    print(json.dumps({"form": form, "median_kept": round(statistics.median(kept), 4), "blocks": kept}))
with open(sys.argv[3], "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in out)
