"""Probe: is the matmul's loss beside the gather kernel a matter of SMs, or of power and clocks?

The matmul (bf16 8192^3, every SM) keeps 0.82-0.88 of its rate beside the kernel on 8 of 132
SMs, more than the SM share (6%) explains; launch priority and 2-CTA clusters changed
nothing. If the GPU runs the matmul at its power limit, the copy kernel's SMs and its PCIe
traffic draw power that lowers the clock of every SM. Phases of ~3 s each: matmul alone,
matmul + kernel reload (8 SMs) queued before or after the matmuls, matmul + copy-engine
reload; twice. Each phase's
start and end are printed (host clock) with its TFLOP/s, and `nvidia-smi` samples the SM clock
and power every 50 ms beside it (see power.sh).
"""

from __future__ import annotations

import functools
import json
import time

import torch
from probe_cluster import ROW_WORDS, ROWS, N, scattered_rows  # same folder (run as a script)

from kvtier.transfer import kernels


def main() -> None:
    host, dev, src_off, dst_off = scattered_rows()
    load_stream, compute = torch.cuda.Stream(), torch.cuda.Stream()
    kernel_load = functools.partial(
        kernels._kernel()[(8,)],
        host, src_off, dev, dst_off, ROWS, ROW_WORDS // 2,
        ROWS_PER_BLOCK=56, ROWS_POW=1, BLOCK=4096, VEC=2, CHECK_ALIGN=False, STAGES=1, num_warps=16,
    )  # fmt: skip
    flat_h, flat_d = host[: ROWS * ROW_WORDS], dev[: ROWS * ROW_WORDS]

    def copy_engine_load() -> None:
        flat_d.copy_(flat_h, non_blocking=True)

    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def phase(name: str, load, seconds: float = 3.0, load_first: bool = True) -> None:
        """Batches of 20 matmuls (timed by events, so waits between batches do not count).

        `load_first`: the reload is queued before the matmuls, so its programs hold their SMs
        when the matmuls start (else after, and its programs wait for free SMs).
        """
        torch.cuda.synchronize()
        t0 = time.time()
        done, gpu_s, load_s, overlap_s = 0, 0.0, 0.0, 0.0
        l0, l1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def reload() -> None:
            if load is not None:
                with torch.cuda.stream(load_stream):
                    l0.record()
                    for _ in range(12):  # ~35 ms of reload beside ~30 ms of matmuls
                        load()
                    l1.record()

        while time.time() - t0 < seconds:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if load_first:
                reload()
            with torch.cuda.stream(compute):
                e0.record()
                for _ in range(20):
                    torch.mm(a, b, out=c)
                e1.record()
            if not load_first:
                reload()
            torch.cuda.synchronize()
            done += 20
            gpu_s += e0.elapsed_time(e1) / 1e3
            if load is not None:
                load_s += l0.elapsed_time(l1) / 1e3
                # How long the reload and the matmuls ran at the same time (ms between events).
                start = max(0.0, e0.elapsed_time(l0))
                overlap_s += max(0.0, min(e0.elapsed_time(e1), e0.elapsed_time(l1)) - start) / 1e3
        t1 = time.time()
        out = {"phase": name, "start": round(t0, 3), "end": round(t1, 3)}
        out["tflops"] = round(done * 2 * N**3 / gpu_s / 1e12, 1)
        if load is not None:
            out["reload_gbps"] = round(12 * ROWS * ROW_WORDS * 8 * (done // 20) / load_s / 1e9, 1)
            out["overlap_of_matmul_time"] = round(overlap_s / gpu_s, 2)
        print(json.dumps(out))

    phase("warmup", None, 2.0)
    for _ in range(2):
        phase("alone", None)
        phase("kernel first", kernel_load)
        phase("kernel after", kernel_load, load_first=False)
        phase("copy engine", copy_engine_load)


if __name__ == "__main__":
    main()
