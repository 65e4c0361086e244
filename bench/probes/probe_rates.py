"""What the sixth session's transfer probes share: a JSON-lines log, CUDA-event rates, the ceiling.

`Probe(out_path)` opens the log; `probe.emit(row)` prints a row and appends it; `probe.timed(fn,
nbytes)` is the GB/s of `fn` on the probe's stream, the median of `repeats` after one warm-up;
`probe.ceilings()` the copy engine's GB/s for one 256 MiB contiguous copy each way;
`scattered_rows(rows, words, device)` one layer of random rows scattered on both sides, and
`MatmulRounds` the matmul timed beside a reload (the fifth and seventh sessions' kernel probes).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvtier.bench.overlap import interleave


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


class ScatteredRows(NamedTuple):
    """`rows` rows of `words` int64 words at random host slots (of twice as many) and device slots.

    `host`: `[2 * rows * words]` pinned, random; `dst`: `[rows * words]` on the device, unset;
    `src_off`/`dst_off`: `[rows]` word offsets on the device; `expect`: `[rows, words]`, the rows
    in order on the device, which `dst.view(-1, words)[dev_perm]` must equal after a gather.
    """

    host: torch.Tensor
    dst: torch.Tensor
    host_perm: torch.Tensor
    dev_perm: torch.Tensor
    src_off: torch.Tensor
    dst_off: torch.Tensor
    expect: torch.Tensor


def scattered_rows(rows: int, words: int, device: torch.device, seed: int = 1) -> ScatteredRows:
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(-(2**62), 2**62, (2 * rows * words,), dtype=torch.int64, generator=gen).pin_memory()
    dst = torch.empty(rows * words, dtype=torch.int64, device=device)
    host_perm = torch.randperm(2 * rows, generator=gen)[:rows]
    dev_perm = torch.randperm(rows, generator=gen)
    src_off = (host_perm * words).to(device)
    dst_off = (dev_perm * words).to(device)
    expect = host.view(-1, words)[host_perm].to(device)
    return ScatteredRows(host, dst, host_perm, dev_perm, src_off, dst_off, expect)


class MatmulRounds:
    """A bf16 `n` x `n` matmul loop on its own stream, timed in rounds beside a reload or alone.

    The overlap bench's method (`kvtier.bench.overlap`): a round issues `lead + matmuls`
    matmuls and, beside them, enough calls of `reload` (each ~`call_s` seconds) to cover them,
    interleaved; only the last `matmuls` are timed.
    """

    def __init__(self, device: torch.device, n: int = 8192) -> None:
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.compute = torch.cuda.Stream(device)

    def matmul(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def round_s(
        self,
        reload: Callable[[], None] | None,
        matmuls: int,
        per_matmul: float,
        lead: int,
        call_s: float = 0.0,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[float, float]:
        """Seconds of the last `matmuls`, and the reloads' own seconds per call (timed on `stream`)."""
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        reloads = max(1, int((lead + 0.9 * matmuls) * per_matmul / call_s)) if reload else 0
        timed = reload is not None and stream is not None
        if timed:
            ev[2].record(stream)

        def mm(i: int) -> None:
            if i == lead:
                ev[0].record(self.compute)
            with torch.cuda.stream(self.compute):
                self.matmul()

        interleave(lead + matmuls, reloads, reload or (lambda: None), mm)
        ev[1].record(self.compute)
        if timed:
            ev[3].record(stream)
        torch.cuda.synchronize()
        per_call = ev[2].elapsed_time(ev[3]) / 1e3 / reloads if timed else 0.0
        return ev[0].elapsed_time(ev[1]) / 1e3, per_call
