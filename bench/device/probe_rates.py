"""What the sixth session's transfer probes share: a JSON-lines log, CUDA-event rates, the ceiling.

`Probe(out_path)` opens the log; `probe.emit(row)` prints a row and appends it; `probe.timed(fn,
nbytes)` is the GB/s of `fn` on the probe's stream, the median of `repeats` after one warm-up;
`probe.ceilings()` the copy engine's GB/s for one 256 MiB contiguous copy each way.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch


class Probe:
    def __init__(self, out_path: str, repeats: int = 7) -> None:
        self.device = torch.device("cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.repeats = repeats
        self.log = open(out_path, "w")  # noqa: SIM115 - kept open for the whole probe

    def emit(self, row: dict) -> None:
        print(json.dumps(row), flush=True)
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()

    def timed(self, fn: Callable[[], None], nbytes: int) -> float:
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.synchronize()
        rates = []
        for _ in range(self.repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(self.stream)
            with torch.cuda.stream(self.stream):
                fn()
            e1.record(self.stream)
            e1.synchronize()
            rates.append(nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9)
        return statistics.median(rates)

    def ceilings(self) -> tuple[float, float]:
        n = 256 << 20
        h = torch.empty(n, dtype=torch.uint8).pin_memory()
        d = torch.empty(n, dtype=torch.uint8, device=self.device)
        return self.timed(lambda: d.copy_(h, non_blocking=True), n), self.timed(
            lambda: h.copy_(d, non_blocking=True), n
        )

    def run(self, fn: Callable[[], None]) -> None:
        """`fn` once on the probe's stream, then wait for it (the byte checks)."""
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.synchronize()
