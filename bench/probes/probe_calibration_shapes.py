"""Whether the calibration's shapes are those a plan meets (kvtier.transfer.calibrate).

Two suspected mismatches between what `kvtier calibrate` times and what `kvtier bench transfer`
plans on:

- `copy`: the calibration shifts host and device addresses by the same 16 bytes, while a plan's
  host runs of rows that are not whole lines start at any multiple of the row on the host
  and at line-aligned device slots: timed here with the two sides at the same, and at
  different, offsets within a line, for pieces of 16-64 KiB and 41984 bytes (64 packed fp8 rows);
- `kernel_rows`: the calibration's single rows are scattered on both sides, while the planner
  compares them with staging for host runs of several rows (contiguous on the host) over
  scattered device slots: timed here both ways, for rows of 132, 656 and 1152 bytes.

One JSON line per figure, appended to OUT. Usage: python3 bench/probes/probe_calibration_shapes.py OUT
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from kvtier.pool.device import Direction
from kvtier.transfer import calibrate, dma

PIECES = (16 << 10, 24 << 10, 32 << 10, 41984, 48 << 10, 64 << 10)
SHIFTS = ((0, 0), (16, 16), (0, 16), (16, 0), (0, 64))  # (device, host) bytes past a line
ROWS = (132, 656, 1152)
HOST_RUNS = (1, 16, 64)


def copies(bench: calibrate._Bench, d: Direction, piece: int, dev_shift: int, host_shift: int) -> float:
    count, sizes, fan = calibrate._batch(piece)
    span = piece + 128
    limit = calibrate.SCRATCH_BYTES - span
    host = bench.host.data_ptr() + np.minimum(bench.places(span, count), limit) + host_shift
    dev = bench.dev.data_ptr() + np.minimum(bench.places(span, count), limit) + dev_shift
    dst, src = (dev, host) if d is Direction.LOAD else (host, dev)
    t = bench.time(
        lambda: dma.copy_runs(dst, src, sizes, bench.stream, streams=fan),
        calibrate.COPY_REPEATS,
        calibrate.COPY_BATCH,
    )
    return count * piece / t / 1e9


def kernel_rows(bench: calibrate._Bench, d: Direction, rb: int, host_run: int) -> float:
    """The kernel on single rows of `rb`: device slots scattered, host slots in runs of `host_run`."""
    rows = calibrate.MOVED_BYTES // rb // host_run * host_run
    total = calibrate.SCRATCH_BYTES // rb
    runs = bench.rng.permutation(total // host_run)[: rows // host_run].astype(np.int64) * host_run
    host_at = ((runs[:, None] + np.arange(host_run)).reshape(-1)) * rb
    dev_at = bench.rng.permutation(total)[:rows].astype(np.int64) * rb
    return bench.rate(*bench.kernel_at(d, rb, host_at, dev_at))


def main() -> None:
    bench = calibrate._Bench(torch.device("cuda"))
    with open(sys.argv[1], "a") as out:

        def emit(**row: object) -> None:
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")

        for d in Direction:
            for piece in PIECES:
                for ds, hs in SHIFTS:
                    gbps = copies(bench, d, piece, ds, hs)
                    emit(
                        kind="copy",
                        direction=d.value,
                        piece=piece,
                        dev_shift=ds,
                        host_shift=hs,
                        gbps=round(gbps, 2),
                    )
            for rb in ROWS:
                for run in HOST_RUNS:
                    gbps = kernel_rows(bench, d, rb, run)
                    emit(
                        kind="kernel_rows", direction=d.value, row_bytes=rb, host_run=run, gbps=round(gbps, 2)
                    )


if __name__ == "__main__":
    main()
