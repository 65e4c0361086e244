"""Probe: why does a copy-engine reload cost the matmul ~6% at the H200's power limit?

The bench's rounds (kvtier bench overlap): copy engine 0.937-0.942, kernel on 8 SMs 0.957-0.963;
nvidia-smi sampled too sparsely during the copy-engine rounds to say whether clocks fell. Here
the SM clock and power are sampled in-process through NVML (ctypes, every 20 ms) and rounds of
~2 s alternate, after 8 s of matmuls, between: the matmuls alone; beside host -> device copies
queued after the matmuls (as in the bench); the same queued before them; device -> host copies.
Then host -> device copies paced to 3/4 and 1/2 of the time by GPU sleeps between them; then
alone and beside host -> device copies with the matmuls replayed from a CUDA graph; then (fourth
session) host -> device copies made by cudaMemcpyBatchAsync, one copy per call, with the
PreferOverlapWithCompute hint and without it. One line of JSON per round.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import threading
import time

import torch

N, LAYER = 8192, 151 * 2**20


class Nvml:
    """SM clock (MHz) and power (W) of GPU 0, sampled in a thread."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.h = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h)) == 0
        self.samples: list[tuple[float, int, float]] = []
        self.period, self.stop = period_s, False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        clock, mw = ctypes.c_uint(), ctypes.c_uint()
        while not self.stop:
            self.lib.nvmlDeviceGetClockInfo(self.h, 1, ctypes.byref(clock))  # NVML_CLOCK_SM
            self.lib.nvmlDeviceGetPowerUsage(self.h, ctypes.byref(mw))
            self.samples.append((time.time(), clock.value, mw.value / 1e3))
            time.sleep(self.period)

    def between(self, t0: float, t1: float) -> tuple[float, float, int]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return 0.0, 0.0, 0
        return statistics.median(s[1] for s in inside), statistics.median(s[2] for s in inside), len(inside)


def batched_copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, hint: bool):
    """A copy of all of `src` into `dst` as one cudaMemcpyBatchAsync of one copy on `stream`."""
    import numpy as np
    from cuda.bindings import runtime as cr

    from kvtier.transfer import cudart

    fn = cudart.runtime().lib.cudaMemcpyBatchAsync
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes, fn.restype = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, ptr], ctypes.c_int
    attrs = cr.cudaMemcpyAttributes()
    attrs.srcAccessOrder = cr.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    if hint:
        attrs.flags = cr.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    arrays = [np.array([x], dtype=np.int64) for x in (dst.data_ptr(), src.data_ptr(), src.numel())]
    index = (ctypes.c_size_t * 1)(0)

    def copy() -> None:
        d, s_, n = (a.ctypes.data for a in arrays)
        err = fn(d, s_, n, 1, attrs.getPtr(), index, 1, stream.cuda_stream)
        assert err == 0, f"cudaMemcpyBatchAsync: {err}"

    copy.keep = (attrs, arrays, index)  # type: ignore[attr-defined]
    return copy


def main(eager_pairs: int = 3, pacing_pairs: int = 0, graph_pairs: int = 3, batch_pairs: int = 0) -> None:
    """Repetitions of the eager rounds, the paced ones, the graph ones and the batched-call ones
    (call 5: 3, 0, 0 (the graph rounds came later); call 6: 1, 0, 3; call 7: 1, 2, 0; fourth
    session: 1, 0, 0, 3)."""
    nvml = Nvml()
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    host = torch.empty(LAYER, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(LAYER, dtype=torch.uint8, device="cuda")
    compute, side = torch.cuda.Stream(), torch.cuda.Stream()
    copies = {
        "h2d": lambda: dev.copy_(host, non_blocking=True),
        "d2h": lambda: host.copy_(dev, non_blocking=True),
    }

    def paced(duty: float):
        """Host -> device copies at `duty` of the time: each followed by a GPU sleep (one SM)."""
        cycles = int(LAYER / 55e9 * (1 / duty - 1) * 1.98e9)

        def copy() -> None:
            dev.copy_(host, non_blocking=True)
            torch.cuda._sleep(cycles)

        return copy

    graph, per_graph = None, 50

    def matmuls(k: int) -> None:
        with torch.cuda.stream(compute):
            if graph is not None:
                for _ in range(k // per_graph):
                    graph.replay()
                return
            for _ in range(k):
                torch.mm(a, b, out=c)

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record(compute)
    matmuls(20)
    e1.record(compute)
    torch.cuda.synchronize()
    per = e0.elapsed_time(e1) / 1e3 / 20
    k = int(2.0 / per)

    def round_(name: str, copy=None, first: bool = False, gbps: float = 50.0) -> None:
        """~2 s of matmuls, with copies for ~80% of that time (at `gbps`) beside them."""
        torch.cuda.synchronize()
        t0 = time.time()
        n = max(1, int(0.8 * k * per / (LAYER / (gbps * 1e9)))) if copy else 0

        def queue_copies() -> None:
            with torch.cuda.stream(side):
                c0.record(side)
                for _ in range(n):
                    copy()
                c1.record(side)

        if copy and first:
            queue_copies()
        e0.record(compute)
        matmuls(k)
        e1.record(compute)
        if copy and not first:
            queue_copies()
        torch.cuda.synchronize()
        mm_s = e0.elapsed_time(e1) / 1e3
        out = {"round": name, "tflops": round(2 * N**3 * k / mm_s / 1e12, 1)}
        if copy:
            out["copy_gbps"] = round(n * LAYER / (c0.elapsed_time(c1) / 1e3) / 1e9, 1)
            # The copies' share of the matmuls' time (events on both streams, one clock).
            overlap = min(e0.elapsed_time(e1), e0.elapsed_time(c1)) - max(0.0, e0.elapsed_time(c0))
            out["overlap"] = round(max(0.0, overlap) / (mm_s * 1e3), 2)
        clock, watts, m = nvml.between(t0 + 0.3, time.time())
        out.update(sm_mhz=clock, watts=round(watts), samples=m)
        print(json.dumps(out), flush=True)

    round_("warm", None)
    torch.cuda.synchronize()
    t = time.time()
    while time.time() - t < 8:
        matmuls(50)
        torch.cuda.synchronize()
    for _ in range(eager_pairs):
        round_("alone")
        round_("h2d after", copies["h2d"])
        round_("alone")
        round_("h2d first", copies["h2d"], first=True)
        round_("alone")
        round_("d2h after", copies["d2h"])
    round_("alone")
    if batch_pairs:
        hinted, plain = (batched_copy(dev, host, side, hint) for hint in (True, False))
        for _ in range(batch_pairs):
            round_("h2d batch hint", hinted)
            round_("alone")
            round_("h2d batch plain", plain)
            round_("alone")
    for _ in range(pacing_pairs):
        for duty in (0.75, 0.5):
            round_(f"h2d paced {duty}", paced(duty), gbps=55 * duty)
            round_("alone")
    # The same with the matmuls replayed from a CUDA graph of 50 (launched by the GPU, not fetched
    # one by one from the host's command buffers over the link the copies fill).
    if graph_pairs:
        with torch.cuda.stream(compute):
            torch.mm(a, b, out=c)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=compute):
                for _ in range(per_graph):
                    torch.mm(a, b, out=c)
        k = k // per_graph * per_graph
        for _ in range(graph_pairs):
            round_("graph alone")
            round_("graph h2d after", copies["h2d"])
        round_("graph alone")
    nvml.stop = True


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5]))
