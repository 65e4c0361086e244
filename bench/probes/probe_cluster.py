"""Probe: does launching the gather kernel's programs as 2-CTA clusters cut the matmul's loss?

Measured so far: a bf16 8192^3 matmul loop keeps 0.87 of its rate beside the gather kernel on
8 SMs, 0.93 on 4 and 0.83 on 16 (priority of the load stream: no effect). Holding 8 of 132
SMs should cost 6%, not 13%. Hypothesis: the matmul runs 2-CTA clusters, which must fit in
one GPC; 8 copy programs spread over 8 GPCs leave an odd SM free in each, which no cluster
can use, so ~16 SMs are lost. Programs launched as 2-CTA clusters (Triton `num_ctas=2`, each
program's tile split over two CTAs of one GPC) would take SMs in pairs.

Same rows as the transfer bench's worst case: 131072 scattered rows of 1152 B, pinned host ->
device. Per variant: byte check (poisoned destination), GB/s alone, then the matmul alone and
beside a reload loop, alternated 7 times (medians). One JSON line per variant.
"""

from __future__ import annotations

import functools
import json
import statistics

import torch

from kvtier.transfer import kernels

ROWS, ROW_WORDS = 131072, 144  # int64 words of 1152 B
N = 8192


def scattered_rows(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(host, dev, src_off, dst_off)`: pinned and device words of 2 * ROWS rows, and the word
    offsets (on the GPU) of ROWS scattered rows to gather from one into the other."""
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(-(2**62), 2**62, (2 * ROWS * ROW_WORDS,), generator=gen).pin_memory()
    dev = torch.empty(2 * ROWS * ROW_WORDS, dtype=torch.int64, device="cuda")
    src_off = (torch.randperm(2 * ROWS, generator=gen)[:ROWS] * ROW_WORDS).cuda()
    dst_off = (torch.randperm(2 * ROWS, generator=gen)[:ROWS] * ROW_WORDS).cuda()
    return host, dev, src_off, dst_off


def main() -> None:
    host, dev, src_off, dst_off = scattered_rows()
    load_stream, compute = torch.cuda.Stream(), torch.cuda.Stream()
    kernel = kernels._kernel()
    nbytes = ROWS * ROW_WORDS * 8
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    # (name, programs, CTAs per program, rows per program): 8 SMs each but the last
    variants = [("8 programs", 8, 1, 56), ("4 clusters of 2", 4, 2, 112), ("2 clusters of 4", 2, 4, 224)]
    for name, programs, ctas, rows in variants:
        row_vecs = ROW_WORDS // 2  # 16-byte chunks
        block = 1 << (rows * row_vecs - 1).bit_length()

        load = functools.partial(
            kernel[(programs,)],
            host, src_off, dev, dst_off, ROWS, row_vecs,
            ROWS_PER_BLOCK=rows, ROWS_POW=1, BLOCK=block, VEC=2, CHECK_ALIGN=False, STAGES=1, num_warps=16,
            num_ctas=ctas,
        )  # fmt: skip

        out = {"variant": name, "programs": programs, "ctas_per_program": ctas, "sms": programs * ctas}
        try:
            dev.fill_(-1)
            with torch.cuda.stream(load_stream):
                load()
            load_stream.synchronize()
            got = dev.view(-1, ROW_WORDS)[dst_off.cpu() // ROW_WORDS]
            want = host.view(-1, ROW_WORDS)[src_off.cpu() // ROW_WORDS]
            out["identical"] = bool(torch.equal(got.cpu(), want))
        except Exception as e:  # a probe reports what failed and moves on
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(out), flush=True)
            continue
        ms = []
        for _ in range(12):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(load_stream):
                e0.record()
                for _ in range(4):
                    load()
                e1.record()
            e1.synchronize()
            ms.append(e0.elapsed_time(e1) / 4)
        out["alone_gbps"] = round(nbytes / statistics.median(ms[2:]) / 1e6, 2)

        def matmul_tflops(with_load: bool, load=load) -> float:
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(compute):
                e0.record()
                for _ in range(40):
                    torch.mm(a, b, out=c)
                e1.record()
            if with_load:
                with torch.cuda.stream(load_stream):
                    for _ in range(25):  # ~75 ms of reload, longer than the matmuls
                        load()
            torch.cuda.synchronize()
            return 40 * 2 * N**3 / (e0.elapsed_time(e1) / 1e3) / 1e12

        matmul_tflops(False)
        matmul_tflops(True)
        alone, beside = [], []
        for _ in range(7):
            alone.append(matmul_tflops(False))
            beside.append(matmul_tflops(True))
        out["matmul_alone_tflops"] = round(statistics.median(alone), 1)
        out["matmul_beside_tflops"] = round(statistics.median(beside), 1)
        out["matmul_kept"] = round(statistics.median(beside) / statistics.median(alone), 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
