"""Whether one layer's two buffers of fully scattered rows move faster with their kernel launches
side by side on two streams than one after the other: `glm-5`'s 1152-byte latent rows and 132-byte
indexer rows of the same 131072 tokens, host slots scattered over twice as many, device slots
scattered or contiguous, each launch on an exact number of programs (`KernelOptions(lean=False)`).

Why: one after the other the indexer's rows, two read requests each and bound by the programs' requests
in flight, run at ~0.5 of the ceiling while the latent's 2 programs already hold the link's plateau;
side by side the indexer's requests might fill what the latent leaves.

Per direction and device set, each variant byte-checked first (destinations poisoned), then GB/s of
both buffers over one contiguous pinned copy of the same bytes timed in the same run. One JSON line
per row appended to OUT. Usage: python3 bench/probes/probe_buffers_beside.py OUT
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from kvtier.pool.device import Direction
from kvtier.transfer import kernels
from kvtier.transfer.calibrate import held_median_s
from kvtier.transfer.options import KernelOptions

TOKENS = 131072
SLOTS = 2 * TOKENS
ROWS = {"latent": (1152, torch.int64), "indexer": (132, torch.int32)}
# (latent programs, indexer programs, side by side)
VARIANTS = {
    Direction.LOAD: [
        (2, 8, False),
        (2, 6, True),
        (3, 5, True),
        (2, 4, True),
        (1, 7, True),
        (2, 8, True),
        (4, 4, True),
    ],
    Direction.BACKUP: [(4, 8, False), (4, 4, True), (3, 5, True), (2, 6, True), (5, 3, True), (4, 8, True)],
}
REPEATS, BATCH, HOLD = 10, 4, 4_000_000

dev = torch.device("cuda")
rng = np.random.default_rng(0)
main, side = torch.cuda.Stream(), torch.cuda.Stream()
host = {n: torch.empty(SLOTS * rb, dtype=torch.uint8).pin_memory().view(w) for n, (rb, w) in ROWS.items()}
devb = {n: torch.empty(SLOTS * rb, dtype=torch.uint8, device=dev).view(w) for n, (rb, w) in ROWS.items()}
for n in ROWS:
    host[n].view(torch.uint8).copy_(
        torch.randint(0, 256, (host[n].numel() * host[n].element_size(),), dtype=torch.uint8)
    )
host_slots = rng.permutation(SLOTS)[:TOKENS].astype(np.int64)


_offsets: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def words(n: str) -> int:
    rb, w = ROWS[n]
    return rb // torch.empty(0, dtype=w).element_size()


def launch_one(n: str, d: Direction, programs: int, dev_slots: np.ndarray) -> None:
    rb, _ = ROWS[n]
    rw = words(n)
    key = (n, dev_slots.tobytes()[:64], len(dev_slots))
    if key not in _offsets:  # made once, outside any timing
        _offsets[key] = (torch.from_numpy(host_slots * rw).to(dev), torch.from_numpy(dev_slots * rw).to(dev))
    h_off, d_off = _offsets[key]
    align = 128 if rb % 128 == 0 else 4
    launch = KernelOptions(sm_budget=programs, lean=False).launch(rb, align, dev, d)
    load = d is Direction.LOAD
    src, dst = (host[n], devb[n]) if load else (devb[n], host[n])
    so, do = (h_off, d_off) if load else (d_off, h_off)
    kernels.copy_rows(
        src,
        so,
        dst,
        do,
        rw,
        sm_budget=launch.programs,
        rows_per_program=launch.rows,
        validate=False,
        offsets_align=align // host[n].element_size(),
        stages=launch.stages,
    )


def make_call(d: Direction, pl: int, pi: int, beside: bool, dev_slots: np.ndarray):
    def call() -> None:
        if not beside:
            launch_one("latent", d, pl, dev_slots)
            launch_one("indexer", d, pi, dev_slots)
            return
        s = torch.cuda.current_stream()
        side.wait_stream(s)
        with torch.cuda.stream(side):
            launch_one("latent", d, pl, dev_slots)
        launch_one("indexer", d, pi, dev_slots)
        s.wait_stream(side)

    return call


def check(d: Direction, call, dev_slots: np.ndarray) -> bool:
    for n in ROWS:
        (devb[n] if d is Direction.LOAD else host[n]).view(torch.uint8).fill_(0xA5)
        if d is Direction.BACKUP:
            devb[n].view(torch.uint8).copy_(
                torch.randint(
                    0, 256, (devb[n].numel() * devb[n].element_size(),), dtype=torch.uint8, device=dev
                )
            )
    with torch.cuda.stream(main):
        call()
    main.synchronize()
    ok = True
    for n in ROWS:
        rw = words(n)
        h = host[n].view(SLOTS, rw)[torch.from_numpy(host_slots)]
        g = devb[n].view(SLOTS, rw)[torch.from_numpy(dev_slots).to(dev)].cpu()
        ok &= bool(torch.equal(h, g))
    return ok


def ceiling(d: Direction) -> float:
    nbytes = TOKENS * sum(rb for rb, _ in ROWS.values())
    h = host["latent"].view(torch.uint8)[:nbytes]
    g = devb["latent"].view(torch.uint8)[:nbytes]
    t = held_median_s(
        main,
        (lambda: g.copy_(h, non_blocking=True))
        if d is Direction.LOAD
        else (lambda: h.copy_(g, non_blocking=True)),
        REPEATS,
        BATCH,
        HOLD,
    )
    return nbytes / t / 1e9


def main_() -> None:
    out = sys.argv[1]
    nbytes = TOKENS * sum(rb for rb, _ in ROWS.values())
    for d in Direction:
        for dev_set in ("scattered", "contiguous"):
            dev_slots = (
                rng.permutation(SLOTS)[:TOKENS] if dev_set == "scattered" else np.arange(TOKENS)
            ).astype(np.int64)
            ceil = ceiling(d)
            for pl, pi, beside in VARIANTS[d]:
                call = make_call(d, pl, pi, beside, dev_slots)
                ok = check(d, call, dev_slots)
                call()
                t = held_median_s(main, call, REPEATS, BATCH, HOLD)
                row = {
                    "direction": d.value,
                    "device": dev_set,
                    "latent_programs": pl,
                    "indexer_programs": pi,
                    "beside": beside,
                    "gbps": round(nbytes / t / 1e9, 2),
                    "ceiling_gbps": round(ceil, 2),
                    "ceiling_ratio": round(nbytes / t / 1e9 / ceil, 3),
                    "identical": ok,
                }
                print(json.dumps(row), flush=True)
                with open(out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
            for n, p in (("latent", 2 if d is Direction.LOAD else 4), ("indexer", 8)):
                t = held_median_s(
                    main, lambda n=n, p=p, d=d, ds=dev_slots: launch_one(n, d, p, ds), REPEATS, BATCH, HOLD
                )
                b = TOKENS * ROWS[n][0]
                row = {
                    "direction": d.value,
                    "device": dev_set,
                    "alone": n,
                    "programs": p,
                    "gbps": round(b / t / 1e9, 2),
                    "ceiling_ratio": round(b / t / 1e9 / ceil, 3),
                }
                print(json.dumps(row), flush=True)
                with open(out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main_()
