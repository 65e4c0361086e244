"""The host's cost of an engine decode step without the model's forward, by running requests (issue 43).

On a GPU the host builds a decode step's layout and stages it into the CUDA graph's static
buffers before the replay, and after the read-back does each request's bookkeeping; none of it
overlaps the graph. This probe measures that work on the CPU: a tiny Llama engine prefills `N`
requests (prompts of `CTX` tokens) through the real CPU forward, then the runner is switched to
the paged path with a stand-in `DecodeGraphs` whose graphs hold CPU tensors and whose replay does
nothing (logits fixed), so `Engine.step()` runs every host line of a graph step (`_forward_paged`,
`HostLayout.of`, `DecodeGraphs.run`, the staging) and nothing of the model. `eager` mode instead
runs the eager paged path (`HostLayout.stage`, `PagedStep`) with `_run` stubbed.

Phases (median us per step over `STEPS` steps): `expire`, `schedule`, `forward` (the host part of
the runner's forward), `choose` (`choose_all`: batched sampling over the fixed logits and the one
read-back), `advance` (the rest of `_advance`: per-request updates, finish checks, `Update`s).

`PYTHONPATH=.:tests python3 bench/probes/probe_engine_host.py [OUT.json] [graph|eager] [CTX=512]`
`PROFILE=tottime` (or `cumtime`) prints cProfile's table of the timed steps to stderr.
"""

from __future__ import annotations

import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from kvtier.engine import Engine, SamplingParams
from kvtier.engine import graphs as graphs_mod

STEPS = 60


def _timed(log: dict[str, list[float]], name: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log[name].append(time.perf_counter() - t)

    return wrapper


class _NoGraph:
    def replay(self) -> None:
        pass


def _cpu_graphs(eng: Engine, width: int, vocab: int) -> graphs_mod.DecodeGraphs:
    """A `DecodeGraphs` over CPU tensors, every bucket 'captured', replay a no-op."""
    g = object.__new__(graphs_mod.DecodeGraphs)
    g.buckets = graphs_mod.buckets_up_to(eng.scheduler.max_num_seqs)
    g.enabled, g.captures, g._graphs = True, 0, {}
    logits = torch.randn(g.buckets[-1], vocab)
    for b in g.buckets:
        head, layout = graphs_mod.static_layout(b, width, torch.device("cpu"))
        g._graphs[b] = graphs_mod._Graph(head, layout, None, _NoGraph(), logits[:b], width)
    return g


def measure(n: int, ctx: int, mode: str) -> dict:
    from tiny_models import tiny_llama

    model = tiny_llama(vocab_size=256, max_positions=ctx + 2 * STEPS + 16)
    tokens = n * (ctx + 2 * STEPS + 16)
    eng = Engine(
        model,
        device_tokens=tokens,
        host_tokens=tokens,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=max(8192, ctx),
        prefix_cache=True,
    )
    rng = np.random.default_rng(n)
    params = SamplingParams(max_tokens=2 * STEPS + 8, ignore_eos=True)
    for _ in range(n):
        eng.submit(rng.integers(0, 256, ctx).tolist(), params)
    while any(r.computed < len(r.prompt) for r in [*eng.scheduler.running, *eng.scheduler.waiting]):
        eng.step()
    for _ in range(3):
        eng.step()  # real decodes
    assert eng.num_running == n and eng.num_waiting == 0
    runner = eng.runner
    runner.paged = True
    vocab = 256
    if mode == "graph":
        runner.graphs = _cpu_graphs(
            eng, max(graphs_mod.MIN_WIDTH, 1 << (ctx + 2 * STEPS).bit_length()), vocab
        )
    else:
        logits = torch.randn(n, vocab)
        runner.graphs = None
        runner._run = lambda step: logits[: step.layout.last.shape[0]]
    log: dict[str, list[float]] = {
        k: [] for k in ("expire", "schedule", "forward", "choose", "advance", "step")
    }
    eng._expire = _timed(log, "expire", eng._expire)
    eng.scheduler.schedule = _timed(log, "schedule", eng.scheduler.schedule)
    runner.forward = _timed(log, "forward", runner.forward)
    runner.choose_all = _timed(log, "choose", runner.choose_all)
    eng._advance = _timed(log, "advance", eng._advance)
    for _ in range(5):
        eng.step()
    for v in log.values():
        v.clear()
    prof = cProfile.Profile() if os.environ.get("PROFILE") else None
    for _ in range(STEPS):
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        ups = eng.step()
        if prof is not None:
            prof.disable()
        log["step"].append(time.perf_counter() - t)
        assert len(ups) == n, len(ups)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats(os.environ["PROFILE"]).print_stats(40)
    med = {k: statistics.median(v) * 1e6 for k, v in log.items()}
    med["advance"] -= med["choose"]  # the rest of `_advance`
    eng.close()
    return {
        "running": n,
        "us": {k: round(v, 1) for k, v in med.items()},
        "us_per_request": round(med["step"] / n, 2),
    }


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    mode = sys.argv[2] if len(sys.argv) > 2 else "graph"
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    torch.set_num_threads(1)
    rows = []
    for n in map(int, os.environ.get("RUNNING", "1,16,64,128").split(",")):
        r = measure(n, ctx, mode)
        rows.append(r)
        print(json.dumps(r), flush=True)
    meta = {
        "mode": mode,
        "ctx": ctx,
        "steps": STEPS,
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    if out:
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
