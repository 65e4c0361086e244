"""Probe: 132-byte DSA indexer rows, G layers of a token at once, with 16-byte accesses on the host side.

Call 1 of the sixth session (probe_layer_groups.py): grouping G layers of a token (page_first,
page 1) lifts 656-byte rows from 0.78 to 0.88 of the ceiling, but 132-byte rows only from 0.46
to 0.50 (loads), since their rows are 4-byte aligned and the kernel moves them in 4-byte lanes.
Here a token's G rows (G a multiple of 4: G * 132 bytes, 16-byte aligned) are read from the host
in 16-byte lanes and written to the device word by word (each word to its layer's row), and the
reverse for backups; also the library kernel at larger tiles and grids for comparison.
One JSON line per shape; argv: output path, groups, "tokens x programs" shapes.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from probe_rates import Probe

from kvtier.transfer import kernels

out_path = sys.argv[1]
GROUPS = [int(x) for x in sys.argv[2].split(",")]
SHAPES = [tuple(int(v) for v in s.split("x")) for s in sys.argv[3].split(",")]
N, RW = 131072, 33
probe = Probe(out_path)
dev, emit, timed = probe.device, probe.emit, probe.timed


@triton.jit
def split_rows(
    packed, packed_off, split, split_off, layer_stride, n_tok,
    G: tl.constexpr, RW: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr, LOAD: tl.constexpr,
):  # fmt: skip
    """Token t: G*RW words at packed[packed_off[t]:] <-> layer l's row at split[split_off[t] + l*stride:]."""
    CH: tl.constexpr = G * RW // 4
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    in_blk = lane < TOK * CH
    k = tl.arange(0, 4)
    for blk in range(pid, tl.cdiv(n_tok, TOK), tl.num_programs(0)):
        t = blk * TOK + lane // CH
        m = in_blk & (t < n_tok)
        c = lane % CH
        p = tl.load(packed_off + t, mask=m, other=0)
        s = tl.load(split_off + t, mask=m, other=0)
        w = c[:, None] * 4 + k[None, :]
        sp = split + (s[:, None] + (w // RW) * layer_stride + w % RW)
        pp = packed + (tl.multiple_of(p + c * 4, 4)[:, None] + k[None, :])
        if LOAD:
            tl.store(sp, tl.load(pp, mask=m[:, None]), mask=m[:, None])
        else:
            tl.store(pp, tl.load(sp, mask=m[:, None]), mask=m[:, None])


ceil_load, ceil_back = probe.ceilings()
emit({"ceiling_load": ceil_load, "ceiling_backup": ceil_back})
gen = torch.Generator().manual_seed(6)
host_slots, dev_slots = torch.randperm(N, generator=gen), torch.randperm(N, generator=gen)
for g in GROUPS:
    nbytes = N * g * RW * 4
    host = torch.randint(-(2**31), 2**31 - 1, (N * g * RW,), dtype=torch.int32, generator=gen).pin_memory()
    device = torch.empty(g * N * RW, dtype=torch.int32, device=dev)
    saved = host.clone()
    expect = host.view(N, g, RW)[host_slots].transpose(0, 1).to(dev)
    tok_p = (host_slots * g * RW).to(dev)
    tok_s = (dev_slots * RW).to(dev)
    layer = torch.arange(g)
    row_p = ((host_slots[:, None] * g + layer[None, :]) * RW).reshape(-1).to(dev)
    row_s = ((layer[None, :] * N + dev_slots[:, None]) * RW).reshape(-1).to(dev)
    bufs = (host, device, tok_p, tok_s, g, row_p, row_s)
    for tok, programs in SHAPES:
        for kind in ("split", "rows"):
            if kind == "split":
                if g % 4:
                    continue
                ch = g * RW // 4
                block = triton.next_power_of_2(tok * ch)
                warps = max(1, min(32, block * 16 // 4096))

                def run(load: bool, tok=tok, block=block, warps=warps, programs=programs, bufs=bufs) -> None:
                    host, device, tok_p, tok_s, g = bufs[:5]
                    split_rows[(programs,)](
                        host, tok_p, device, tok_s, N * RW, N,
                        G=g, RW=RW, TOK=tok, BLOCK=block, LOAD=load, num_warps=warps,
                    )  # fmt: skip
            else:
                rows = max(1, tok * g)

                def run(load: bool, rows=rows, programs=programs, bufs=bufs) -> None:
                    host, device, row_p, row_s = bufs[0], bufs[1], bufs[5], bufs[6]
                    src, src_off, dst, dst_off = (
                        (host, row_p, device, row_s) if load else (device, row_s, host, row_p)
                    )
                    kernels.copy_rows(
                        src, src_off, dst, dst_off, RW,
                        sm_budget=programs, rows_per_program=rows, validate=False, offsets_align=RW,
                    )  # fmt: skip

            device.fill_(-1)
            probe.run(lambda run=run: run(True))
            load_ok = bool(torch.equal(device.view(g, N, RW)[:, dev_slots], expect))
            host.fill_(-1)
            probe.run(lambda run=run: run(False))
            back_ok = bool(torch.equal(host, saved))
            lg, bg = timed(lambda run=run: run(True), nbytes), timed(lambda run=run: run(False), nbytes)
            emit({
                "kind": kind, "group": g, "tokens": tok, "programs": programs, "load_ok": load_ok,
                "backup_ok": back_ok, "load_frac": round(lg / ceil_load, 3),
                "backup_frac": round(bg / ceil_back, 3), "load_gbps": round(lg, 2),
                "backup_gbps": round(bg, 2),
            })  # fmt: skip
    del host, device, saved, expect, bufs
