"""Whether batched copies of thousands of pieces are bound by the host's issuing, and how each timing
method sees it (`kvtier bench transfer`'s Timer against `kvtier calibrate`'s held batches).

For pieces of 32-64 KiB (41984 bytes: 64 packed fp8 rows), `COUNT` pieces between random places of
pinned and device scratch, fanned over 1, 4 and 8 streams, per direction:

- `issue_ms`: host time to issue one call (`dma.copy_runs`), the stream held by a long GPU sleep;
- `gpu_ms`: GPU time of one call, every call issued before the stream is released (long hold);
- `bench_ms`: as `kvtier bench transfer` times it (a 1 ms hold, 4 back-to-back calls);
- `calib_ms`: as `kvtier calibrate` times copies (a 2 ms hold, 2 back-to-back calls).

One JSON line per case, appended to OUT. Usage: python3 bench/probes/probe_copy_issue.py OUT
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from kvtier.bench.common import held_times
from kvtier.pool.device import Direction
from kvtier.transfer import dma

SCRATCH = 256 << 20
CASES = ((41984, 2048), (41984, 3196), (32768, 4096), (32768, 16384 // 4), (65536, 2048), (36864, 4096))
STREAMS = (1, 4, 8)


def issue_and_gpu_ms(stream: torch.cuda.Stream, call, calls: int = 4) -> tuple[float, float]:
    """Host ms to issue one call and GPU ms of one, `calls` issued behind a 50 ms sleep (median of 5)."""
    host, gpu = [], []
    with torch.cuda.stream(stream):
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(100_000_000)
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            host.append((time.perf_counter() - t0) * 1e3 / calls)
            end.record(stream)
            end.synchronize()
            gpu.append(start.elapsed_time(end) / calls)
    return statistics.median(host), statistics.median(gpu)


def main() -> None:
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    rng = np.random.default_rng(0)
    host = torch.empty(SCRATCH, dtype=torch.uint8).pin_memory()
    dev = torch.empty(SCRATCH, dtype=torch.uint8, device=device)
    with open(sys.argv[1], "a") as out:
        for d in Direction:
            for piece, count in CASES:
                at_h = rng.permutation(SCRATCH // piece)[:count].astype(np.int64) * piece + host.data_ptr()
                at_d = rng.permutation(SCRATCH // piece)[:count].astype(np.int64) * piece + dev.data_ptr()
                dst, src = (at_d, at_h) if d is Direction.LOAD else (at_h, at_d)
                sizes = np.full(count, piece, dtype=np.int64)
                for k in STREAMS:

                    def call(dst=dst, src=src, sizes=sizes, k=k) -> None:
                        dma.copy_runs(dst, src, sizes, stream, streams=k)

                    call()
                    issue, gpu = issue_and_gpu_ms(stream, call)
                    bench = held_times(stream, call, 10, 4, 2_000_000)[0] * 1e3
                    calib = held_times(stream, call, 3, 2, 4_000_000)[0] * 1e3
                    mb = piece * count / 1e6
                    row = {
                        "direction": d.value,
                        "piece": piece,
                        "count": count,
                        "streams": k,
                        "issue_ms": round(issue, 3),
                        "gpu_ms": round(gpu, 3),
                        "bench_ms": round(bench, 3),
                        "calib_ms": round(calib, 3),
                        "gpu_gbps": round(mb / gpu, 1),
                        "bench_gbps": round(mb / bench, 1),
                        "calib_gbps": round(mb / calib, 1),
                        "issue_gbps": round(mb / issue, 1),
                    }
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
