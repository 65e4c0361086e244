"""Probe: what do the gather kernel's SMs cost the matmul, and can fewer SMs move the same bytes?

The overlap bench (fourth session, call 8): the matmul keeps 0.922 of its rate beside the
gather kernel on 8 SMs (8 / 132 = 6.1% of the SMs), the reload itself at 0.78 of the ceiling.
A C probe (2026-11-30) read scattered 1152-byte rows at 0.92 of the ceiling with 4 blocks of
1024 threads as with 8 of 512: what fills the link is bytes in flight, not SMs.

Here, after matmuls alone until their rate settles (as the bench), rounds alternate between the
matmul alone and beside one of:
- the gather kernel (scattered 1152-byte rows of a 131072-row layer, host -> device) on 8, 4 or
  2 programs with 64, 128 or 256 KiB in flight per program (16 or 32 warps);
- a spin kernel that holds 8 or 4 SMs (16 warps, dependent arithmetic, no memory traffic) for
  about as long as a layer's reload: the cost of holding the SMs alone.
Every kernel shape is checked byte-identical first (poisoned destination) and timed alone.
One JSON line per round and per shape; argv: output path, passes, shapes, "spin".
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from probe_rates import MatmulRounds, scattered_rows

from kvtier.bench.overlap import LEAD_S, ROUND_S, settle
from kvtier.transfer import kernels

out_path, passes = sys.argv[1], int(sys.argv[2])
ROWS, ROW_BYTES, N = 131072, 1152, 8192
WORDS = ROW_BYTES // 8  # int64 words per row
dev = torch.device("cuda")
log = open(out_path, "w")  # noqa: SIM115 - kept open for the whole probe


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    log.flush()


host, dst, host_perm, dev_perm, src_off, dst_off, expect = scattered_rows(ROWS, WORDS, dev)
stream = torch.cuda.Stream(dev)


def ceiling_gbps() -> float:
    flat = host[: ROWS * WORDS]
    with torch.cuda.stream(stream):
        dst.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(stream)
    with torch.cuda.stream(stream):
        for _ in range(10):
            dst.copy_(flat, non_blocking=True)
    e1.record(stream)
    torch.cuda.synchronize()
    return 10 * ROWS * ROW_BYTES / (e0.elapsed_time(e1) / 1e3) / 1e9


def _resources(k) -> dict:
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "shared": getattr(getattr(k, "metadata", None), "shared", None)}  # fmt: skip


def gather(programs: int, rows_per_block: int, warps: int):
    """One layer's scattered gather with the library's kernel at the given grid and tile."""
    vec = 2  # 16-byte chunks of int64 words
    row_vecs = WORDS // vec
    block = triton.next_power_of_2(rows_per_block * row_vecs)
    kern = kernels._kernel()
    meta: dict = {}

    def call() -> None:
        with torch.cuda.stream(stream):
            k = kern[(programs,)](
                host, src_off, dst, dst_off, ROWS, row_vecs,
                ROWS_PER_BLOCK=rows_per_block, ROWS_POW=1, BLOCK=block, VEC=vec, CHECK_ALIGN=False, STAGES=1,
                num_warps=warps,
            )  # fmt: skip
        if not meta:
            meta.update(_resources(k))

    return call, meta


@triton.jit
def _spin(x_ptr, iters, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in range(iters):
        x = x * 0.9999999 + 0.0000001
    tl.store(x_ptr + offs, x)


def spin(programs: int, seconds: float):
    """A kernel on `programs` SMs (16 warps each) that runs ~`seconds` alone and touches no memory."""
    block = 16 * 32 * 4
    x = torch.zeros(programs * block, device=dev)
    meta: dict = {"iters": 1000}

    def launch(iters: int):
        with torch.cuda.stream(stream):
            return _spin[(programs,)](x, iters, BLOCK=block, num_warps=16)

    k = launch(1000)
    meta.update(_resources(k))
    torch.cuda.synchronize()
    meta["iters"] = max(1, int(1000 * seconds / time_alone(lambda: launch(1000))))

    def call() -> None:
        launch(meta["iters"])

    return call, meta


def time_alone(call, reps: int = 10) -> float:
    call()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(stream)
    for _ in range(reps):
        call()
    e1.record(stream)
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / 1e3 / reps


rounds = MatmulRounds(dev, N)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    rounds.matmul()
    torch.cuda.synchronize()
names = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
ceiling = ceiling_gbps()
emit({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
      "sms": torch.cuda.get_device_properties(dev).multi_processor_count, "matmul_kernels": names,
      "ceiling_gbps": round(ceiling, 2)})  # fmt: skip

# argv[3]: the kernel shapes, "programs x rows per program x warps" joined by commas (default the
# first call's four); argv[4]: "spin" to add the spin kernels.
SHAPES = sys.argv[3] if len(sys.argv) > 3 else "8x56x16,4x113x16,4x113x32,2x227x32"
shapes = {}
for shape in SHAPES.split(","):
    programs, rows, warps = (int(x) for x in shape.split("x"))
    kib = rows * ROW_BYTES // 1024
    shapes[f"kernel {programs} x {kib} KiB ({warps} warps)"] = gather(programs, rows, warps)
variants = {}
for name, (call, meta) in shapes.items():
    dst.fill_(-1)
    call()
    torch.cuda.synchronize()
    same = torch.equal(dst.view(-1, WORDS)[dev_perm], expect)
    sec = time_alone(call)
    gbps = ROWS * ROW_BYTES / sec / 1e9
    ratio = round(gbps / ceiling, 3)
    emit({"shape": name, "identical": same, "gbps": round(gbps, 2), "of_ceiling": ratio, **meta})
    if same:
        variants[name] = (call, sec)
layer_s = ROWS * ROW_BYTES / ceiling / 1e9
for sms in (8, 4) if sys.argv[4:] == ["spin"] else ():
    call, meta = spin(sms, layer_s)
    sec = time_alone(call, 5)
    emit({"shape": f"spin {sms} SMs", "seconds": round(sec * 1e3, 3), **meta})
    variants[f"spin {sms} SMs"] = (call, sec)


def round_s(reload, matmuls: int, per_matmul: float, lead: int, call_s: float = 0.0) -> tuple[float, float]:
    """Seconds of the last `matmuls` of `lead + matmuls`, and the reloads' own seconds per call."""
    return rounds.round_s(reload, matmuls, per_matmul, lead, call_s, stream)


per_matmul = round_s(None, 20, 0.0, 0)[0] / 20
matmuls = max(20, int(ROUND_S / per_matmul))
t0 = time.time()
warm = settle(lambda: round_s(None, matmuls, per_matmul, 0)[0])
per_matmul = warm[-1] / matmuls
matmuls = max(20, int(ROUND_S / per_matmul))
lead = int(LEAD_S / per_matmul)
flops = 2 * N**3 * matmuls
emit({"settled_s": round(time.time() - t0, 1), "warm_rounds": len(warm),
      "tflops_settled": round(flops / warm[-1] / 1e12, 1)})  # fmt: skip


def alone() -> float:
    return flops / round_s(None, matmuls, per_matmul, lead)[0] / 1e12


kept: dict[str, list[float]] = {name: [] for name in variants}
prev = alone()
for p in range(passes):
    for name, (call, sec) in variants.items():
        for _ in range(2):
            mm_s, per_call = round_s(call, matmuls, per_matmul, lead, sec)
            beside = flops / mm_s / 1e12
            nxt = alone()
            k = beside / ((prev + nxt) / 2)
            kept[name].append(k)
            row = {"pass": p, "variant": name, "beside_tflops": round(beside, 1),
                   "alone_tflops": round(prev, 1), "alone_after": round(nxt, 1),
                   "kept": round(k, 4), "call_ms": round(per_call * 1e3, 3),
                   "call_ms_alone": round(sec * 1e3, 3)}  # fmt: skip
            if name.startswith("kernel"):
                row["reload_of_ceiling"] = round(ROWS * ROW_BYTES / per_call / 1e9 / ceiling, 3)
            emit(row)
            prev = nxt
for name, ks in kept.items():
    med = round(statistics.median(ks), 4)
    emit({"variant": name, "median_kept": med, "rounds": [round(k, 4) for k in ks]})
