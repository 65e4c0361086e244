"""Probe: do asynchronous copies (a pipelined loop) keep more bytes in flight per SM?

The gather kernel holds a tile of rows in registers: a program loads the tile, waits for all of
it, stores it, then loads the next, and 128 KiB per program is the most that fits without spills
(fifth session). On 4 SMs it reads scattered 1152-byte rows at 0.917-0.921 of the copy engine's
ceiling, on 8 at 0.92-0.93, and each SM it holds costs a matmul beside it ~1% of its rate.

Here the loop over row blocks is pipelined by Triton (`tl.range(..., num_stages=S)`): the loads
of the next `S - 1` tiles go out as `cp.async` copies into shared memory while the current tile is
stored, so a program keeps up to `(S - 1)` tiles in flight from shared memory (228 KB per SM)
instead of registers. The rows' offsets are loaded once per row and spread over the lanes with
`tl.gather` (loading them per lane, as the library's kernel does, would stage as many offset bytes
as data bytes). Prediction: 3 programs with 3 tiles of 64 KiB in flight reach the 8-program rate
(0.92-0.93), and the matmul beside them keeps ~0.96-0.97.

Each shape is checked byte-identical (poisoned destination), timed alone in three passes against
the copy engine's ceiling measured between them, and the chosen shapes beside the matmul as in
`probe_sm_cost.py` (rounds alternating with the matmul alone after it settles).
argv: output path, shapes ("PxRxWxS" joined by commas: programs, rows per tile, warps, stages;
S = 0 is the library's kernel), shapes for the matmul rounds, passes of them.
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from probe_rates import MatmulRounds, Probe, scattered_rows

from kvtier.bench.overlap import LEAD_S, ROUND_S, settle
from kvtier.transfer import kernels

ROWS, ROW_BYTES, N = 131072, 1152, 8192
WORDS = ROW_BYTES // 8
VEC = 2  # int64 words per 16-byte chunk


@triton.jit
def _pipelined(
    src_ptr, src_off_ptr, dst_ptr, dst_off_ptr, n_rows, row_vecs,
    ROWS_PER_BLOCK: tl.constexpr, ROWS_POW: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(n_rows, ROWS_PER_BLOCK)
    lane = tl.arange(0, BLOCK)
    r = tl.arange(0, ROWS_POW)
    in_block = lane < ROWS_PER_BLOCK * row_vecs
    row_of_lane = tl.minimum(lane // row_vecs, ROWS_POW - 1)
    w = (lane % row_vecs) * VEC
    k = tl.arange(0, VEC)
    for block in tl.range(pid, num_blocks, tl.num_programs(0), num_stages=STAGES):
        first = block * ROWS_PER_BLOCK
        mr = (r < ROWS_PER_BLOCK) & (first + r < n_rows)
        s = tl.gather(tl.load(src_off_ptr + first + r, mask=mr, other=0), row_of_lane, 0)
        d = tl.gather(tl.load(dst_off_ptr + first + r, mask=mr, other=0), row_of_lane, 0)
        mask = (in_block & (first + lane // row_vecs < n_rows))[:, None]
        s_vec = tl.multiple_of(s + w, VEC)
        d_vec = tl.multiple_of(d + w, VEC)
        vals = tl.load(src_ptr + (s_vec[:, None] + k[None, :]), mask=mask)
        tl.store(dst_ptr + (d_vec[:, None] + k[None, :]), vals, mask=mask)


out_path, shapes_arg, mm_shapes_arg, passes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
probe = Probe(out_path, repeats=5)
dev, stream = probe.device, probe.stream
host, dst, host_perm, dev_perm, src_off, dst_off, expect = scattered_rows(ROWS, WORDS, dev)
NBYTES = ROWS * ROW_BYTES


def gather(programs: int, rows: int, warps: int, stages: int):
    row_vecs = WORDS // VEC
    block = triton.next_power_of_2(rows * row_vecs)
    meta: dict = {}

    def call() -> None:
        with torch.cuda.stream(stream):
            if stages == 0:
                kern = kernels._kernel()[(programs,)](
                    host, src_off, dst, dst_off, ROWS, row_vecs,
                    ROWS_PER_BLOCK=rows, ROWS_POW=1, BLOCK=block, VEC=VEC, CHECK_ALIGN=False, STAGES=1,
                    num_warps=warps,
                )  # fmt: skip
            else:
                kern = _pipelined[(programs,)](
                    host, src_off, dst, dst_off, ROWS, row_vecs,
                    ROWS_PER_BLOCK=rows, ROWS_POW=triton.next_power_of_2(rows), BLOCK=block, VEC=VEC,
                    STAGES=stages, num_warps=warps, num_stages=stages,
                )  # fmt: skip
        if not meta:
            meta.update(regs=kern.n_regs, spills=kern.n_spills, shared=kern.metadata.shared)

    return call


def repeat(call, reps: int = 10):
    def calls() -> None:
        for _ in range(reps):
            call()

    return calls


probe.emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__})
calls, metas = {}, {}
for shape in shapes_arg.split(","):
    p, rows, warps, stages = (int(x) for x in shape.split("x"))
    call = gather(p, rows, warps, stages)
    dst.fill_(-1)
    probe.run(call)
    same = torch.equal(dst.view(-1, WORDS)[dev_perm], expect)
    probe.emit({"shape": shape, "identical": same, "tile_kib": rows * ROW_BYTES / 1024})
    if same:
        calls[shape] = call
rates: dict[str, list[float]] = {name: [] for name in calls}
for p in range(3):
    load_ceiling, _ = probe.ceilings()
    for name, call in calls.items():
        gbps = probe.timed(repeat(call), 10 * NBYTES)
        rates[name].append(gbps / load_ceiling)
        probe.emit({"pass": p, "shape": name, "gbps": round(gbps, 2), "ceiling": round(load_ceiling, 2),
                    "of_ceiling": round(gbps / load_ceiling, 4)})  # fmt: skip
for name, rs in rates.items():
    probe.emit(
        {
            "shape": name,
            "median_of_ceiling": round(statistics.median(rs), 4),
            "passes": [round(x, 4) for x in rs],
        }
    )

# The matmul beside the chosen shapes.
rounds = MatmulRounds(dev, N)


def round_s(reload, matmuls: int, per_matmul: float, lead: int, call_s: float = 0.0) -> float:
    """Seconds of the last `matmuls` of `lead + matmuls`, reloads issued beside them throughout."""
    return rounds.round_s(reload, matmuls, per_matmul, lead, call_s)[0]


mm_shapes = [s for s in mm_shapes_arg.split(",") if s in calls]
if mm_shapes:
    per_matmul = round_s(None, 20, 0.0, 0) / 20
    matmuls = max(20, int(ROUND_S / per_matmul))
    warm = settle(lambda: round_s(None, matmuls, per_matmul, 0))
    per_matmul = warm[-1] / matmuls
    matmuls = max(20, int(ROUND_S / per_matmul))
    lead = int(LEAD_S / per_matmul)
    flops = 2 * N**3 * matmuls
    probe.emit({"warm_rounds": len(warm), "tflops_settled": round(flops / warm[-1] / 1e12, 1)})
    kept: dict[str, list[float]] = {name: [] for name in mm_shapes}
    prev = flops / round_s(None, matmuls, per_matmul, lead) / 1e12
    for p in range(passes):
        for name in mm_shapes:
            sec = NBYTES / (statistics.median(rates[name]) * load_ceiling * 1e9)
            for _ in range(2):
                beside = flops / round_s(calls[name], matmuls, per_matmul, lead, sec) / 1e12
                nxt = flops / round_s(None, matmuls, per_matmul, lead) / 1e12
                kept[name].append(beside / ((prev + nxt) / 2))
                probe.emit({"pass": p, "mm_shape": name, "beside": round(beside, 1), "alone": round(prev, 1),
                            "alone_after": round(nxt, 1), "kept": round(kept[name][-1], 4)})  # fmt: skip
                prev = nxt
    for name, ks in kept.items():
        probe.emit(
            {
                "mm_shape": name,
                "median_kept": round(statistics.median(ks), 4),
                "rounds": [round(k, 4) for k in ks],
            }
        )
