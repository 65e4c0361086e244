"""Flat-tile gather without a per-tile barrier, against `kernels.copy_rows`, same call.

For rows of 1152 B (deepseek-v3 bf16), 656 B (packed fp8), 2112 B (DSA indexer page of 16)
and 132 B (DSA indexer row): fully scattered host rows <-> scattered device rows, load and
backup, GB/s against one contiguous pinned copy of the same bytes. Every variant is checked
byte for byte (poisoned destination).
"""

import functools
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from kvtier.transfer.kernels import copy_rows

out = os.environ.get("OUT", "/tmp/out")


@triton.jit
def flat_kernel(
    src, src_off, dst, dst_off, n_rows, row_vecs, RPB: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    k = tl.arange(0, VEC)
    in_block = lane < RPB * row_vecs
    for block in range(pid, tl.cdiv(n_rows, RPB), nprog):
        rows = block * RPB + lane // row_vecs
        mask = in_block & (rows < n_rows)
        w = (lane % row_vecs) * VEC
        s = tl.multiple_of(tl.load(src_off + rows, mask=mask, other=0) + w, VEC)
        d = tl.multiple_of(tl.load(dst_off + rows, mask=mask, other=0) + w, VEC)
        v = tl.load(src + (s[:, None] + k[None, :]), mask=mask[:, None])
        tl.store(dst + (d[:, None] + k[None, :]), v, mask=mask[:, None])


def timed(fn, reps=10, batch=4):
    ms = []
    for r in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        if r >= 2:
            ms.append(a.elapsed_time(b) / batch)
    return statistics.median(ms)


def ceiling(n_words, wdt, host):
    flat_h = host[:n_words]
    flat_d = torch.empty(n_words, dtype=wdt, device="cuda")
    nbytes = n_words * flat_h.element_size()
    load = timed(functools.partial(flat_d.copy_, flat_h, non_blocking=True))
    backup = timed(functools.partial(flat_h.copy_, flat_d, non_blocking=True))
    return {"load": nbytes / load / 1e6, "backup": nbytes / backup / 1e6}


def variants(src, so, dst, dso, n, row_w, row_bytes, vec):
    row_vecs = row_w // vec
    out = {
        "copy_rows_auto": functools.partial(
            copy_rows, src, so, dst, dso, row_w, validate=False, offsets_align=row_w
        )
    }
    for sm, warps, tile_kb in ((8, 16, 64), (8, 8, 32), (16, 8, 32), (8, 16, 128)):
        rpb = max(1, tile_kb * 1024 // row_bytes)
        block = triton.next_power_of_2(rpb * row_vecs)
        if block > 16384:
            continue
        out[f"flat_{sm}x{warps}w_{tile_kb}k"] = functools.partial(
            flat_kernel[(sm,)], src, so, dst, dso, n, row_vecs, RPB=rpb, BLOCK=block, VEC=vec, num_warps=warps
        )
    return out


def case(row_bytes, n, wdt, res):
    wsize = torch.empty((), dtype=wdt).element_size()
    row_w = row_bytes // wsize
    slots = 2 * n
    host = torch.randint(-(2**30), 2**30, (slots * row_w,), dtype=wdt).pin_memory()
    dev = torch.randint(-(2**30), 2**30, (slots * row_w,), dtype=wdt, device="cuda")
    hrows = torch.randperm(slots)[:n]
    drows = torch.randperm(slots)[:n]
    ho, do = (hrows * row_w).cuda(), (drows * row_w).cuda()
    nbytes = n * row_bytes
    ceil = ceiling(nbytes // wsize, wdt, host)
    vec = 1
    while vec * 2 * wsize <= 16 and row_w % (vec * 2) == 0:
        vec *= 2
    for direction in ("load", "backup"):
        src, dst, so, dso = (host, dev, ho, do) if direction == "load" else (dev, host, do, ho)
        src_rows, dst_rows = (hrows, drows) if direction == "load" else (drows, hrows)
        for name, fn in variants(src, so, dst, dso, n, row_w, row_bytes, vec).items():
            want = src.view(-1, row_w)[src_rows].cpu()
            fn()
            torch.cuda.synchronize()
            ok = bool(torch.equal(dst.view(-1, row_w)[dst_rows].cpu(), want))
            gbps = nbytes / timed(fn) / 1e6
            row = {
                "row_bytes": row_bytes,
                "direction": direction,
                "variant": name,
                "gbps": round(gbps, 2),
                "of_ceiling": round(gbps / ceil[direction], 3),
                "identical": ok,
            }
            res.append(row)
            print(row, flush=True)


res = []
for rb, n, wdt in (
    (1152, 131072, torch.int64),
    (656, 131072, torch.int64),
    (2112, 8192, torch.int64),
    (132, 131072, torch.int32),
):
    case(rb, n, wdt, res)
with open(f"{out}/probe_flat.json", "w") as fh:
    json.dump(res, fh, indent=1)
