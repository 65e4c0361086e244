"""Where a CUDA-graph decode step's time goes, by running requests (issue 43): the host's work before
the replay, the replay on the GPU, sampling and the read-back, the host's work after.

Llama-3.1-8B shape, bf16, random weights, 512-token prompts, graphs on; for 1, 16 and 64 running,
`STEPS` decode steps, each split by perf_counter on the host and CUDA events on the stream:
- `host_pre_ms`: step start to the graph's inputs staged (`graphs.fill` returned): the expiry check,
  the schedule, the layout and the staging;
- `replay_gpu_ms`: events after the staging and at `choose_all`'s entry: the graph on the GPU;
- `replay_host_ms`: the host's time from the staging to `choose_all` (the replay's launch);
- `sample_gpu_ms`: events at `choose_all`'s entry and before its read-back: batched sampling;
- `choose_ms`: `choose_all`'s host wall (waits for the replay and sampling, reads back);
- `host_post_ms`: `choose_all`'s return to the step's end (each request's bookkeeping);
- `step_ms`: the step's wall; `weight_copy_ms`: the same run's device copy of the weights' bytes;
- `eager_kernels`: one more step run eagerly under torch's profiler, its kernels by device time
  (the graph replays the same kernels): which of them grows with the running requests.
If `replay_gpu_ms` grows with running requests as `step_ms` does, the slope is the device's
(attention over the slot tables, the splits), not the host's.

Usage, from the repository root on the GPU machine: `source bench/device/setup.sh;
python3 bench/device/engine_step_split.py "$OUT/engine_step_split_${GPU}_$DATE.json" [--smoke]`
(about 2 minutes; `--smoke`: the tiny shape).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, "bench/device")
from engine_bound import weight_copy_s

from kvtier.bench.common import environment
from kvtier.bench.engines import bench_model
from kvtier.engine import Engine, SamplingParams, graphs, runner

STEPS = 30
PROMPT = 512


def split(eng: Engine, n: int, vocab: int) -> dict:
    rng = np.random.default_rng(n)
    params = SamplingParams(max_tokens=STEPS + 16, ignore_eos=True)
    reqs = [eng.submit(p, params) for p in rng.integers(0, vocab, (n, PROMPT)).tolist()]
    while eng.num_waiting or any(not r.tokens for r in reqs):
        eng.step()
    for _ in range(3):  # captures this bucket's graph
        eng.step()
    marks: dict[str, float] = {}
    events: dict[str, torch.cuda.Event] = {}

    def event(name: str) -> None:
        events[name] = e = torch.cuda.Event(enable_timing=True)
        e.record()

    fill, choose_all, read_back = graphs.fill, eng.runner.choose_all, runner.read_back

    def fill_timed(*a):
        fill(*a)
        marks["staged"] = time.perf_counter()
        event("staged")

    def choose_timed(*a):
        marks["choose"] = time.perf_counter()
        event("choose")
        out = choose_all(*a)
        marks["chosen"] = time.perf_counter()
        return out

    def read_back_timed(*a):
        event("read")
        return read_back(*a)

    graphs.fill, eng.runner.choose_all, runner.read_back = fill_timed, choose_timed, read_back_timed
    rows = []
    try:
        for _ in range(STEPS):
            marks.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ups = eng.step()
            t1 = time.perf_counter()
            if len(ups) != n or "staged" not in marks:
                raise RuntimeError(f"{len(ups)} updates of {n}, staged: {'staged' in marks} (a graph step?)")
            rows.append(
                {
                    "host_pre_ms": (marks["staged"] - t0) * 1e3,
                    "replay_host_ms": (marks["choose"] - marks["staged"]) * 1e3,
                    "replay_gpu_ms": events["staged"].elapsed_time(events["choose"]),
                    "sample_gpu_ms": events["choose"].elapsed_time(events["read"]),
                    "choose_ms": (marks["chosen"] - marks["choose"]) * 1e3,
                    "host_post_ms": (t1 - marks["chosen"]) * 1e3,
                    "step_ms": (t1 - t0) * 1e3,
                }
            )
        out = {"running": n, **{k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}}
        out["eager_kernels"] = eager_kernels(eng)
    finally:
        graphs.fill, runner.read_back = fill, read_back
        del eng.runner.choose_all
        for r in reqs:
            eng.cancel(r)
    return out


def eager_kernels(eng: Engine, top: int = 12) -> list[dict]:
    """The same step run eagerly under torch's profiler: its `top` kernels by device time (ms in
    the step, launches), the graph's kernels being the same ones."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    eng.runner.graphs.enabled = False
    try:
        eng.step()  # the eager step's shapes once before the profiled one
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            eng.step()
            torch.cuda.synchronize()
    finally:
        eng.runner.graphs.enabled = True
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if device_us:
            rows.append({"name": e.key[:90], "ms": round(device_us / 1e3, 3), "count": e.count})
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def main() -> None:
    path, smoke = sys.argv[1], "--smoke" in sys.argv
    dev = torch.device("cuda")
    model, _, name = bench_model(None, "tiny" if smoke else "llama-3.1-8b", dev, "bfloat16")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = int(model.get_input_embeddings().num_embeddings)
    report = {"meta": {**environment(dev), "model": name, "weight_bytes": nbytes, "prompt": PROMPT}}
    report["weight_copy_ms"] = round(weight_copy_s(nbytes, dev) * 1e3, 3)
    running = (1, 4) if smoke else (1, 16, 64)
    eng = Engine(model, device_tokens=max(running) * (PROMPT + STEPS + 32), host_tokens=8192,
                 max_num_seqs=max(running), max_num_batched_tokens=8192, prefix_cache=False)  # fmt: skip
    try:
        report["rows"] = rows = [split(eng, n, vocab) for n in running]
    finally:
        eng.close()
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "eager_kernels"}), flush=True)
        for k in r["eager_kernels"][:6]:
            print(f"   {k['ms']:8.3f} ms {k['count']:5d}x {k['name']}", flush=True)
    print(f"weight copy {report['weight_copy_ms']} ms", flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
