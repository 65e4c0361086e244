"""Probe: do small scattered rows reach the line rate when several layers of a token move together?

Fifth session: fully scattered 132-byte DSA indexer rows load at 0.53-0.58 of the ceiling and
656-byte fp8 MLA rows at 0.85, whatever the grid or tile. A fit over the three row sizes
(bench/FINDINGS.md, ceilings) says a row costs ~1.5 ns per 128-byte-line read request plus
its bytes: a 132-byte row needs two requests whatever its alignment. In the `page_first`
host layout at page size 1 a token's rows of consecutive layers are adjacent, so a gather that
takes `G` layers of each token at once, rows ordered token-major, reads `G * row` contiguous
bytes per token: a warp's loads cross row boundaries and fill whole lines.

For rows of 132, 656 and 1152 bytes and G in 1, 2, 4, 8, 16: `N` tokens on fully scattered host
and device slots, host `[N, G, row]` (page_first, page 1), device `[G, N, row]` (one tensor per
layer, here one tensor). Each shape is checked byte-identical (poisoned destination) in both
directions, then timed (CUDA events, median of repeats) against the copy engine's ceiling of the
same run. One JSON line per shape; argv: output path, row sizes, groups, sm budget.
"""

from __future__ import annotations

import sys

import torch
from probe_rates import Probe

from kvtier.transfer import kernels

out_path = sys.argv[1]
ROW_SIZES = [int(x) for x in sys.argv[2].split(",")]
GROUPS = [int(x) for x in sys.argv[3].split(",")]
BUDGET = int(sys.argv[4]) if len(sys.argv) > 4 else 8
N = 131072
probe = Probe(out_path)
dev, emit, timed = probe.device, probe.emit, probe.timed

gen = torch.Generator().manual_seed(6)
ceil_load, ceil_back = probe.ceilings()
emit({"ceiling_load": ceil_load, "ceiling_backup": ceil_back, "budget": BUDGET})
for row_bytes in ROW_SIZES:
    rw = row_bytes // 4  # int32 words
    host_slots = torch.randperm(N, generator=gen)
    dev_slots = torch.randperm(N, generator=gen)
    for g in GROUPS:
        nbytes = N * g * row_bytes
        if nbytes > 1 << 30:
            continue  # the wide rows need no large groups; keep the probe's memory and time small
        host = torch.randint(
            -(2**31), 2**31 - 1, (N * g * rw,), dtype=torch.int32, generator=gen
        ).pin_memory()
        device = torch.empty(g * N * rw, dtype=torch.int32, device=dev)
        layer = torch.arange(g)
        # Row (t, l), token-major: host [slot, l] <-> device [l, slot].
        src = ((host_slots[:, None] * g + layer[None, :]) * rw).reshape(-1)
        dst = ((layer[None, :] * N + dev_slots[:, None]) * rw).reshape(-1)
        src_d, dst_d = src.to(dev), dst.to(dev)

        def load(src_d=src_d, dst_d=dst_d, host=host, device=device, rw=rw) -> None:
            kernels.copy_rows(
                host, src_d, device, dst_d, rw, sm_budget=BUDGET, validate=False, offsets_align=rw
            )

        def back(src_d=src_d, dst_d=dst_d, host=host, device=device, rw=rw) -> None:
            kernels.copy_rows(
                device, dst_d, host, src_d, rw, sm_budget=BUDGET, validate=False, offsets_align=rw
            )

        # Byte-identical both ways, destinations poisoned first.
        device.fill_(-1)
        probe.run(load)
        expect = host.view(N, g, rw)[host_slots].transpose(0, 1).to(dev)  # [g, N(token order), rw]
        got = device.view(g, N, rw)[:, dev_slots]
        load_ok = bool(torch.equal(got, expect))
        saved = host.clone()
        host.fill_(-1)
        probe.run(back)
        back_ok = bool(torch.equal(host, saved))
        load_gbps, back_gbps = timed(load, nbytes), timed(back, nbytes)
        emit({
            "row_bytes": row_bytes, "group": g, "MB": nbytes / 1e6, "load_ok": load_ok, "backup_ok": back_ok,
            "load_gbps": round(load_gbps, 2), "backup_gbps": round(back_gbps, 2),
            "load_frac": round(load_gbps / ceil_load, 3), "backup_frac": round(back_gbps / ceil_back, 3),
        })  # fmt: skip
        del host, device, saved, expect, got
