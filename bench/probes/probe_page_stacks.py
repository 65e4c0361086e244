"""Whether `page_first` pages of fully scattered tokens (host runs of 1, every layer in one call) move
faster as stacks through the copy engine than on the layer-group kernel, now that a window's views
and streams are set up once per span.

Why: the first stacks executor moved single pages at 0.23-0.52 of the ceiling, so single pages stay on
the kernel's layer groups (`PathCosts.stack_min_bytes` = 512 KiB a run), which reach 0.86-0.89 for
`glm-5` and packed fp8, under the goal. Since then the copy-issue probe ran batched copies of
32-64 KiB at 53.5-55 GB/s on the GPU with 0.5-1.0 us of host time each, and a `glm-5` latent page
of 78 layers is 90 KB.

Variants per spec, direction and device set (`kvtier bench transfer`'s machinery: byte check against
the source with destinations poisoned, then GB/s over the same-run pinned copy):
- `planned`: the planner as it stands (the kernel's layer groups);
- `stacked`: every buffer forced onto stacks;
- `mixed-<K>k`: planned with `stack_min_bytes` = K KiB, so pages of K KiB or more go as stacks and
  the rest (the `glm-5` indexer's 10 KB pages) stay on the kernel.
One JSON line per row appended to OUT. Usage: python3 bench/probes/probe_page_stacks.py OUT [SPEC:LAYERS ...]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import torch

import kvtier.transfer.plan as plan_module
from kvtier.bench import transfer as bench
from kvtier.pool.device import Direction
from kvtier.pool.host import HostLayout
from kvtier.spec import preset
from kvtier.transfer.options import PathCosts

SPECS = ["glm-5:78", "deepseek-v3-fp8-packed:61", "deepseek-v3:61", "llama-3.1-8b:32"]
# (label, variants, stack_min_bytes in KiB or 0 for the default)
RUNS = [("", ("planned", "stacked"), 0), ("mixed-32k", ("planned",), 32)]
CUDA = torch.cuda.is_available()
TOKENS = 16384 if CUDA else 256  # a CPU run checks the probe only


def config(spec: str, layers: int, variants: tuple[str, ...]) -> bench.BenchConfig:
    return bench.BenchConfig(
        spec=preset(spec).with_layers(layers),
        tokens=TOKENS,
        layout=HostLayout.PAGE_FIRST,
        device=torch.device("cuda" if CUDA else "cpu"),
        repeats=10 if CUDA else 1,
        warmup=2 if CUDA else 0,
        cycles=8,
        host_sets=("runs-1",),
        variants=variants,
        directions=(Direction.LOAD, Direction.BACKUP),
        layers=layers,
        staging_tokens=131072 if CUDA else 512,
    )


def emit(out, spec: str, layers: int, label: str, rows: list[bench.Row], meta: dict) -> None:
    for r in rows:
        row = dataclasses.asdict(r) | {"spec": spec, "layers": layers, "label": label or r.variant}
        row["ceilings"] = meta.get("ceiling_gbps")
        out.write(json.dumps(row) + "\n")
        print(
            f"{spec:24s} {label or r.variant:10s} {r.direction:6s} {r.device:10s} {r.path:16s} "
            f"{r.gbps:5.1f} GB/s {r.ceiling_ratio:.3f} ok={r.identical} {r.mechanisms}",
            flush=True,
        )


def main() -> None:
    out_path = sys.argv[1]
    specs = sys.argv[2:] or SPECS
    original = plan_module.PathCosts
    with open(out_path, "a") as out:
        for item in specs:
            spec, layers = item.split(":")[0], int(item.split(":")[1])
            for label, variants, kib in RUNS:
                if kib and spec != "glm-5":
                    continue  # one buffer: the same plan as stacked
                if kib:
                    plan_module.PathCosts = functools.partial(PathCosts, stack_min_bytes=kib << 10)
                try:
                    rows, meta = bench.run(config(spec, layers, variants))
                finally:
                    plan_module.PathCosts = original
                emit(out, spec, layers, label, rows, meta)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
