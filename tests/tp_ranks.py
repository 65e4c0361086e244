"""Tensor-parallel ranks for tests: `run_ranks(fn, world, *args)` runs `fn(ranks, *args)` in `world`
processes over gloo (CPU) and returns each rank's result; the scenarios the tests run on them.

Each rank is a process of its own (`spawn`), its process group destroyed when `fn` returns; a
rank that fails or runs past the deadline fails the call, and every rank left is killed.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.multiprocessing as mp

from kvtier.cache.ranks import RankGroup


def run_ranks(fn, world: int, *args, timeout: float = 80) -> list:
    """`fn(ranks, *args)` on each of `world` gloo ranks; their results, by rank."""
    with tempfile.TemporaryDirectory(prefix="kvtier-ranks-") as tmp:
        ctx = mp.start_processes(
            _rank, args=(world, tmp, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{world} ranks ran past {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [pickle.loads((Path(tmp) / f"{r}.pkl").read_bytes()) for r in range(world)]


def _rank(rank: int, world: int, tmp: str, fn, args) -> None:
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        result = fn(RankGroup.from_distributed(), *args)
        (Path(tmp) / f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def counters(metrics) -> dict[str, int]:
    """A cache's integer counters (`CacheMetrics`), by name."""
    return {
        f.name: getattr(metrics, f.name) for f in fields(metrics) if type(getattr(metrics, f.name)) is int
    }


# -- scenarios (run on every rank) ------------------------------------------------------------


def engine_rounds(ranks: RankGroup, checkpoint: str, rounds: list, sizes: dict) -> dict:
    """Rank 0 runs `rounds` (each a list of `(prompt, SamplingParams)` submitted together and
    stepped to the end) on its shard's engine; the other ranks follow.

    Every rank returns the tokens of each request it ran (`tokens[id]`), its cache's counters
    and what each request hit; rank 0's `hits[id]` are its results' device / host hit tokens.
    """
    from kvtier.engine import Engine
    from kvtier.engine.models import load_model

    model, tokenizer = load_model(checkpoint, "cpu", "float32", ranks)
    tokens: dict[int, list[int]] = {}
    hits: dict[int, tuple[int, int]] = {}

    def record(u) -> None:
        if u.token is not None:
            tokens.setdefault(u.request.id, []).append(u.token)
        if u.result is not None:
            hits[u.request.id] = (u.result.device_hit_tokens, u.result.host_hit_tokens)

    with Engine(model, tokenizer, ranks=ranks, **sizes) as eng:
        spec = (eng.spec.buffers[0].name, tuple(eng.spec.buffers[0].row_shape))
        if ranks.rank == 0:
            for batch in rounds:
                reqs = [eng.submit(p, params) for p, params in batch]
                while any(not r.finished for r in reqs):
                    for u in eng.step():
                        record(u)
        else:
            eng.follow(record)
        metrics = counters(eng.cache.metrics)
    return {"tokens": tokens, "hits": hits, "metrics": metrics, "spec": spec}


def engine_storage_restart(ranks: RankGroup, checkpoint: str, store: str, prompt: list, params) -> dict:
    """Rank 0 generates `prompt` on an engine over the `file://` store `store`, waits for its storage
    writes and closes it; then a new engine on every rank (as after a restart) generates it again.

    Every rank returns its storage counters of each engine and rank 0 its two results' tokens and hits.
    """
    from kvtier.engine import Engine
    from kvtier.engine.models import load_model

    model, tokenizer = load_model(checkpoint, "cpu", "float32", ranks)
    sizes = dict(device_tokens=128, host_tokens=1024, page_size=1, storage=f"file://{store}")
    out: dict = {"written": [], "hit_tokens": [], "results": []}
    for _ in range(2):
        with Engine(model, tokenizer, ranks=ranks, **sizes) as eng:
            if ranks.rank == 0:
                result = eng.generate(prompt, params)
                out["results"].append((result.tokens, result.hit, result.storage_hit_tokens))
            else:
                eng.follow()
            eng.cache.flush()
            out["written"].append(eng.storage.metrics.snapshot()["pages_written"])
            out["hit_tokens"].append(eng.cache.metrics.storage_hit_tokens)
    return out
