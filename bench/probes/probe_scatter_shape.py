"""Which launch shape of `copy_rows` scatters fully scattered rows to the host fastest?

`probe_row_bounds.cu` (2026-12-04) scattered 131072 fully scattered 656-byte rows at 0.886 of the
same-run ceiling (8 x 256 threads, 8 16-byte words in flight each: 256 KiB), and the library's
kernel ran 0.735-0.769 at every shape that `kvtier bench transfer --kernel-sweep` tried, on the
same lease. This probe times backups of 131072 rows of 656, 1152 and 2048 bytes. The rows are
drawn from 2 x 131072 host rows, the device rows are contiguous, the host destination is
poisoned, and every row is checked before any timing. The variants:
- `lib-PxR`: `copy_rows` as the planner launches it (GPU offsets, `offsets_align`), P programs of
  R rows per tile (`auto`: the launch rules' rows). The rows are chosen so that a tile's 16-byte
  vectors just fill a power of two (2048 or 4096 lanes, no lane masked off).
- `flat-PxL`: a Triton kernel shaped like the CUDA C one. It takes the layer's vectors as one
  flattened index: lane `t` of the grid takes vectors `t, t + G, ..., t + 7G`, G being the grid's
  lanes.
The variants run in `ROUNDS` round-robin rounds, the order reversed every other round: a lease's
drift shows as spread, not as a difference. Then the SASS of every compiled kernel is read: its
global load and store instructions, by width.

Two earlier versions of this file ran on other leases the same day (their files are in git history):
- `scatter_shape_probe_h200_2026-12-04_words.jsonl`: every shape once, 4- and 8-byte words, and the
  flat kernel with 8-byte vectors too;
- `..._rounds.jsonl`: 656-byte rows only, four rounds.

Usage (GPU): python3 bench/probes/probe_scatter_shape.py OUT.jsonl (from bench/probes, the tree on
PYTHONPATH)
"""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys
from collections import Counter

import numpy as np
import torch
import triton
import triton.language as tl
from probe_tlb import ceilings, emit, median_ms

from kvtier.transfer.kernels import copy_rows

ROWS = 131072


@triton.jit
def flat_kernel(
    src, src_off, dst, dst_off, total, row_vecs, U: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr
):
    """Vector `c` of the flattened rows: row `c // row_vecs`, word `(c % row_vecs) * VEC` of it."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0) * LANES
    i = tl.arange(0, U * LANES)
    lane = pid * LANES + i % LANES
    k = tl.arange(0, VEC)
    for base in range(0, total, grid * U):
        c = base + (i // LANES) * grid + lane  # U vectors a lane, G apart
        mask = c < total
        r = c // row_vecs
        w = (c % row_vecs) * VEC
        s = tl.multiple_of(tl.load(src_off + r, mask=mask, other=0) + w, VEC)
        d = tl.multiple_of(tl.load(dst_off + r, mask=mask, other=0) + w, VEC)
        vals = tl.load(src + (s[:, None] + k[None, :]), mask=mask[:, None])
        tl.store(dst + (d[:, None] + k[None, :]), vals, mask=mask[:, None])


def sass_summary(cache: str) -> dict[str, dict[str, int]]:
    """Each compiled kernel's global loads and stores by instruction, from its cubin."""
    out = {}
    for cubin in glob.glob(f"{cache}/**/*.cubin", recursive=True):
        try:
            sass = subprocess.run(
                ["cuobjdump", "-sass", cubin], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError) as e:
            out[cubin] = {"error": str(e)}
            continue
        ops = Counter(re.findall(r"\b((?:LDG|STG)[A-Z0-9_.]*)", sass))
        out[os.path.basename(os.path.dirname(cubin)) + "/" + os.path.basename(cubin)] = dict(ops)
    return out


# (programs, rows per tile) of `copy_rows` per row size (None: the launch rules' rows); rows chosen
# so that a tile's vectors fill a power of two (rows x 16-byte vectors a row <= 2048 or 4096).
LIB_SHAPES = {
    656: ((8, None), (8, 49), (4, 99), (4, 49), (8, 24)),
    1152: ((4, None), (4, 56), (8, 28), (8, 56), (4, 28)),
    2048: ((4, None), (4, 32), (8, 16), (8, 32), (4, 16)),
}
FLAT_SHAPES = ((8, 256), (4, 512))
ROUNDS = 4


def variants(host: torch.Tensor, dev: torch.Tensor, rows: np.ndarray, row_bytes: int) -> list:
    """(name, call) of every variant on 8-byte words: the library's shapes, then the flat kernel's."""
    out = []
    words = row_bytes // 8
    host_w, dev_w = host.view(torch.int64), dev.view(torch.int64)
    host_off = torch.from_numpy(rows.astype(np.int64)).cuda() * words
    dev_off = torch.arange(ROWS, device="cuda", dtype=torch.int64) * words
    for sms, rpp in LIB_SHAPES[row_bytes]:
        kw = {"sm_budget": sms, "rows_per_program": rpp, "validate": False, "offsets_align": words}
        call = functools.partial(copy_rows, dev_w, dev_off, host_w, host_off, words, **kw)
        out.append((f"lib-{sms}x{rpp or 'auto'}", call))
    for programs, lanes in FLAT_SHAPES:
        args = (dev_w, dev_off, host_w, host_off, ROWS * (words // 2), words // 2)
        kw = {"U": 8, "LANES": lanes, "VEC": 2, "num_warps": lanes // 32}
        out.append((f"flat-{programs}x{lanes}", functools.partial(flat_kernel[(programs,)], *args, **kw)))
    return out


def one_size(out, row_bytes: int, rng: np.random.Generator) -> None:
    """Every variant's backups of 131072 fully scattered rows of `row_bytes`, checked, then timed in
    `ROUNDS` round-robin rounds (the order reversed every other round)."""
    layer = ROWS * row_bytes
    ceiling = ceilings(layer)
    emit(out, {"row_bytes": row_bytes, "ceiling_gbs": {k: round(v, 2) for k, v in ceiling.items()}})
    host = torch.empty(2 * layer, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 256, (layer,), dtype=torch.uint8, device="cuda")
    rows = rng.permutation(2 * ROWS)[:ROWS]
    want = dev.view(ROWS, row_bytes).cpu()
    picked = torch.from_numpy(rows)
    host_rows = host.view(2 * ROWS, row_bytes)
    calls = variants(host, dev, rows, row_bytes)
    for name, fn in calls:  # checked once each, before any is timed
        host_rows[picked] = 0xA5
        fn()
        torch.cuda.synchronize()
        emit(out, {"row_bytes": row_bytes, "variant": name, "ok": bool(torch.equal(host_rows[picked], want))})
    for rnd in range(ROUNDS):
        for name, fn in calls if rnd % 2 == 0 else calls[::-1]:
            ratio = round(layer / median_ms(fn) / 1e6 / ceiling["backup"], 3)
            emit(out, {"round": rnd, "row_bytes": row_bytes, "variant": name, "ratio": ratio})


def main(path: str) -> None:
    rng = np.random.default_rng(7)
    with open(path, "w") as out:
        gpu = torch.cuda.get_device_name()
        emit(out, {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu})
        for row_bytes in LIB_SHAPES:
            one_size(out, row_bytes, rng)
            torch.cuda.synchronize()
        cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
        emit(out, {"sass": sass_summary(cache)})


if __name__ == "__main__":
    main(sys.argv[1])
