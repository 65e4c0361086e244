"""Why a plan's batched copies can run slower than the calibration's copies of the same sizes.

`deepseek-v3-fp8-packed` backups of host runs of 64 rows (41984 bytes) onto contiguous device slots
ran at 0.73-0.78 of the ceiling as copy-engine copies in `kvtier bench transfer`, while the
calibration's batches of pieces of that size run at 54 GB/s (`probe_calibration_shapes.py`). Here,
on the bench's own pools and slot sets, one layer's copies are timed as:

- `plan`: the plan's `backup` / `load_layers` (the planner forced to batched copies);
- `same`: `dma.copy_runs` on the plan's own addresses, sizes and streams;
- `shuffled`: the same copies in a random order;
- `scratch`: as many copies of the same sizes between random places of two scratch buffers.

For `llama-3.1-8b` runs-16 (32 KiB pieces) as well. One JSON line per figure, appended to OUT.
Usage: python3 bench/probes/probe_plan_copies.py OUT
"""

from __future__ import annotations

import json
import sys
from functools import partial

import numpy as np
import torch

from kvtier.bench.churn import runs_of
from kvtier.bench.common import Timer
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import TransferPlan, backup, dma, load_layers
from kvtier.transfer.plan import CopyPart

TOKENS = 131072
CASES = (("deepseek-v3-fp8-packed", 64), ("llama-3.1-8b", 16), ("deepseek-v3", 32))
SCRATCH = 256 << 20


class Probe:
    def __init__(self, out) -> None:
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.timer = Timer(self.device, self.stream)
        self.rng = np.random.default_rng(0)
        self.scratch_h = torch.empty(SCRATCH, dtype=torch.uint8).pin_memory()
        self.scratch_d = torch.empty(SCRATCH, dtype=torch.uint8, device=self.device)
        self.out = out

    def emit(self, nbytes: int, fn, **row: object) -> None:
        row["gbps"] = round(nbytes / self.timer.median_ms(fn, 10, 2, 4) / 1e6, 2)
        print(json.dumps(row), flush=True)
        self.out.write(json.dumps(row) + "\n")

    def case(self, name: str, run: int, gen: torch.Generator) -> None:
        spec = preset(name, 1)
        host, dev = HostPool(spec, 2 * TOKENS), DevicePool(spec, 2 * TOKENS, self.device)
        hs, ds = runs_of(run, TOKENS, 2 * TOKENS, gen), torch.arange(TOKENS)
        nbytes = sum(b.row_bytes for b in spec.buffers) * TOKENS
        for d in Direction:
            what = {"spec": name, "run": run, "direction": d.value}
            plan = TransferPlan.build(d, host, dev, hs, ds, force="batched_dma", stream=self.stream)
            if d is Direction.LOAD:
                self.emit(
                    nbytes, partial(load_layers, plan, host, dev, range(1), self.stream), kind="plan", **what
                )
            else:
                self.emit(
                    nbytes, partial(backup, plan, dev, host, range(1), self.stream), kind="plan", **what
                )
            (part,) = [p for p in plan.parts if isinstance(p, CopyPart)]
            calls = []
            for b in spec.buffers:
                region, host_off, dev_off, sizes = part.run_bytes[b.name]
                hp = host.region_ptrs(b.name)[0, region] + host_off
                dp = dev.layer(b.name, 0).data_ptr() + dev_off
                calls.append((dp, hp, sizes) if d is Direction.LOAD else (hp, dp, sizes))
            for kind, shuffle in (("same", False), ("shuffled", True)):
                self.emit(
                    nbytes,
                    partial(self.copies, calls, shuffle, part.streams),
                    kind=kind,
                    streams=part.streams,
                    **what,
                )
            piece, count = int(calls[0][2][0]), sum(len(c[2]) for c in calls)
            at_h = self.places(piece, count) + self.scratch_h.data_ptr()
            at_d = self.places(piece, count) + self.scratch_d.data_ptr()
            sizes = np.full(count, piece, dtype=np.int64)
            scratch = [(at_d, at_h, sizes) if d is Direction.LOAD else (at_h, at_d, sizes)]
            self.emit(
                count * piece,
                partial(self.copies, scratch, False, part.streams),
                kind="scratch",
                piece=piece,
                count=count,
                **what,
            )

    def places(self, piece: int, count: int) -> np.ndarray:
        return self.rng.permutation(SCRATCH // piece)[:count].astype(np.int64) * piece

    def copies(self, calls: list, shuffle: bool, streams: int) -> None:
        for dst, src, sizes in calls:
            idx = self.rng.permutation(len(sizes)) if shuffle else slice(None)
            dma.copy_runs(dst[idx], src[idx], sizes[idx], self.stream, streams=streams)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    with open(sys.argv[1], "a") as out:
        probe = Probe(out)
        for name, run in CASES:
            probe.case(name, run, gen)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
