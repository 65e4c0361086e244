"""`kvtier bench transfer --gpus N`: every GPU of the host reloading at once, one process each.

Rank i runs in its own process on `devices[i]`. It first binds its CPUs to its GPU's
NUMA node (`kvtier.pool.numa`), then builds what `bench transfer` builds
(`transfer.setup`: its own pinned host pool, device pool, slot sets and ceilings), so
its pinned pool is first touched on that node. Every rank holds the same spec (what one
rank holds: a head-split spec's share of heads, an MLA latent whole) and, from the same
seed, the same slot sets. For each direction, host set and device set, each rank builds
the planner's plan, checks it byte for byte (`transfer.check_plan`), then times it twice:

1. alone: rank after rank, a barrier between, the other ranks waiting in it;
2. together: every rank at once, each sample from a common start.

Timing, alike in both phases: a sample is `batch` back-to-back calls on the host clock
(`time.monotonic`, CLOCK_MONOTONIC: one clock for every process of the host), from
before the first call to after the device is synchronised. Together, the ranks agree on
a start (the latest rank's clock after an all-reduce, plus `START_MARGIN_S`) and spin
until it; the sample spans from the earliest rank's start to the last rank's end, so any
start skew counts against the aggregate. The aggregate rate is every rank's bytes over
the median span; `aggregate_ratio` is it over the mean of the ranks' alone rates in the
same run. A rank's `ceiling_ratio` is its own rate together over its own ceiling (one
contiguous copy, timed by `transfer.setup` on CUDA events as `bench transfer` times it;
the host timing here adds one synchronisation per sample). Figures: `bench/FINDINGS.md`.

Processes: `torch.multiprocessing.spawn`, joined in a gloo group over the CPU through a
file store in a temporary directory, where rank 0 leaves the rows for the caller. Every
rank makes the same collective calls in the same order. A rank that raises ends them
all, and `run` raises `RankError` naming it.
"""

from __future__ import annotations

import logging
import pickle
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Group
from rich.table import Table

from kvtier.bench import transfer
from kvtier.bench.transfer import BenchConfig, Setup
from kvtier.errors import ConfigError, RankError
from kvtier.pool.device import Direction
from kvtier.pool.numa import bind_to_node
from kvtier.transfer import TransferPlan

# Time between the latest rank's clock at the agreement and the common start: room for every
# rank to leave the all-reduce before the start.
START_MARGIN_S = 0.002
# What rank 0 writes in the run's temporary directory: `(rows, meta)`, pickled.
RESULT = "result.pkl"
# What a rank that raised writes there, with its rank after it: its error in one line.
ERROR = "error-"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankRate:
    """One rank's part of a row: its path, its rates alone and together (GB/s), its byte check."""

    rank: int
    path: str
    alone_gbps: float
    together_gbps: float
    ceiling_ratio: float
    identical: bool


@dataclass(frozen=True)
class GpusRow:
    """One direction, host set and device set, reloaded (or backed up) on every rank at once."""

    direction: str
    path: str
    host_runs: str
    host_run_count: int
    device: str
    tokens: int
    # One rank's bytes per call.
    nbytes: int
    gpus: int
    # The median span together, per call.
    ms: float
    # The median, over samples, of the latest rank's start after the earliest's.
    start_skew_ms: float
    # The mean of the ranks' alone rates.
    one_gpu_gbps: float
    aggregate_gbps: float
    aggregate_ratio: float
    # Every rank's byte check passed.
    identical: bool
    ranks: tuple[RankRate, ...]


@dataclass(frozen=True)
class _Timed:
    """What one rank measured of one plan: seconds per sample alone, `(start, end)` per sample together."""

    path: str
    host_run_count: int
    identical: bool
    ceiling_gbps: float
    alone_s: tuple[float, ...]
    together: tuple[tuple[float, float], ...]


def run(cfg: BenchConfig, devices: Sequence[torch.device]) -> tuple[list[GpusRow], dict]:
    """Every rank of `devices` (rank i on `devices[i]`, a process each) at once; the rows and metadata.

    `kvtier bench transfer --gpus N` passes `cuda:0..N-1`; tests pass CPU devices. Only the
    planner's plan is timed (`cfg.variants` and `cfg.kernel_sweep` are not read).
    `RankError` when a rank fails: the lowest rank that raised, with its error.
    """
    if not devices:
        raise ConfigError("a run over ranks needs at least one device")
    with tempfile.TemporaryDirectory(prefix="kvtier-gpus-") as workdir:
        try:
            mp.spawn(_rank_main, args=(tuple(devices), cfg, workdir), nprocs=len(devices), join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise RankError(_failure(Path(workdir), e, len(devices))) from e
        with open(Path(workdir) / RESULT, "rb") as f:
            rows, meta = pickle.load(f)
    return rows, meta


def _failure(workdir: Path, e: mp.ProcessException, world: int) -> str:
    """What failed: the lowest rank that left its error in `workdir`, else what `spawn` saw (a signal)."""
    for rank in range(world):
        error = workdir / f"{ERROR}{rank}"
        if error.exists():
            return f"rank {rank} of {world} failed: {error.read_text()}"
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"rank {e.error_index} of {world} failed: {lines[-1]}"


def _rank_main(rank: int, devices: tuple[torch.device, ...], cfg: BenchConfig, workdir: str) -> None:
    """One rank's process: its pools on `devices[rank]`, every case measured; rank 0 writes the result.

    A rank that raises leaves its error in `workdir` and skips the group's teardown, which
    would fail on the ranks that already left and bury the error that ended them.
    """
    device, world = devices[rank], len(devices)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        node = bind_to_node(device)
        s = transfer.setup(replace(cfg, device=device), lambda msg: log.info("rank %d: %s", rank, msg))
        rows = []
        for direction in cfg.directions:
            for host_label, hs in s.host_sets.items():
                for dev_label, ds in s.dev_sets.items():
                    every: list = [None] * world
                    dist.all_gather_object(every, _measure(s, rank, world, direction, hs, ds))
                    rows.append(_row(s, direction, host_label, dev_label, every))
        ranks: list = [None] * world
        dist.all_gather_object(ranks, _rank_info(s, rank, node))
        if rank == 0:
            with open(Path(workdir) / RESULT, "wb") as f:
                pickle.dump((rows, metadata(s, ranks)), f)
        dist.barrier()
    except Exception as e:
        (Path(workdir) / f"{ERROR}{rank}").write_text(f"{type(e).__name__}: {' '.join(str(e).split())}")
        raise
    dist.destroy_process_group()


def _measure(
    s: Setup, rank: int, world: int, direction: Direction, hs: torch.Tensor, ds: torch.Tensor
) -> _Timed:
    """The planner's plan of `hs` (host slots, `[n]` int64) and `ds` (device slots), checked, then timed
    alone in turn and together; a collective: every rank calls it with the same case."""
    cfg, dev = s.cfg, s.dev.device
    plan = TransferPlan.build(direction, s.host, s.dev, hs, ds, kernel=cfg.kernel, stream=s.stream)
    identical = transfer.check_plan(s, plan)
    op = transfer.plan_op(plan, s.host, s.dev, s.stream, cfg.layers)
    alone: tuple[float, ...] = ()
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            _warm(op, cfg.warmup, dev)
            alone = tuple(
                end - start for start, end in (_sample(op, cfg.batch, dev) for _ in range(cfg.repeats))
            )
    dist.barrier()
    _warm(op, cfg.warmup, dev)
    together = []
    for _ in range(cfg.repeats):
        _wait_for_common_start()
        together.append(_sample(op, cfg.batch, dev))
    return _Timed(plan.path.value, plan.host_runs, identical, s.ceilings[direction], alone, tuple(together))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm(op: Callable[[], None], calls: int, device: torch.device) -> None:
    for _ in range(calls):
        op()
    _synchronize(device)


def _sample(op: Callable[[], None], batch: int, device: torch.device) -> tuple[float, float]:
    """`batch` back-to-back calls: the host clock before the first and after the device has finished."""
    start = time.monotonic()
    for _ in range(batch):
        op()
    _synchronize(device)
    return start, time.monotonic()


def _wait_for_common_start() -> None:
    """Return at the moment every rank agrees on: the latest rank's clock now, plus `START_MARGIN_S`."""
    now = torch.tensor([time.monotonic()], dtype=torch.float64)
    dist.all_reduce(now, op=dist.ReduceOp.MAX)
    start = now.item() + START_MARGIN_S
    while time.monotonic() < start:
        pass  # a spin, not a sleep: a sleep wakes late by more than the skew it should avoid


def _row(s: Setup, direction: Direction, host_label: str, dev_label: str, timed: list[_Timed]) -> GpusRow:
    """The row of one case from every rank's measurements (`timed[r]`: rank r's)."""
    sample_bytes = s.layer_bytes * s.cfg.batch
    samples = range(len(timed[0].together))
    spans = [max(t.together[i][1] for t in timed) - min(t.together[i][0] for t in timed) for i in samples]
    skews = [max(t.together[i][0] for t in timed) - min(t.together[i][0] for t in timed) for i in samples]
    ranks = []
    for r, t in enumerate(timed):
        together = sample_bytes / statistics.median(end - start for start, end in t.together) / 1e9
        ranks.append((r, t, sample_bytes / statistics.median(t.alone_s) / 1e9, together))
    one_gpu = statistics.mean(alone for _, _, alone, _ in ranks)
    aggregate = len(timed) * sample_bytes / statistics.median(spans) / 1e9
    return GpusRow(
        direction=direction.value,
        path=timed[0].path,
        host_runs=host_label,
        host_run_count=timed[0].host_run_count,
        device=dev_label,
        tokens=s.cfg.tokens,
        nbytes=s.layer_bytes,
        gpus=len(timed),
        ms=round(statistics.median(spans) / s.cfg.batch * 1e3, 4),
        start_skew_ms=round(statistics.median(skews) * 1e3, 4),
        one_gpu_gbps=round(one_gpu, 2),
        aggregate_gbps=round(aggregate, 2),
        aggregate_ratio=round(aggregate / one_gpu, 3),
        identical=all(t.identical for t in timed),
        ranks=tuple(
            RankRate(
                r,
                t.path,
                round(alone, 2),
                round(together, 2),
                round(together / t.ceiling_gbps, 3),
                t.identical,
            )
            for r, t, alone, together in ranks
        ),
    )


def _rank_info(s: Setup, rank: int, node: int | None) -> dict:
    device = s.cfg.device
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return {
        "rank": rank,
        "device": str(device),
        "name": name,
        "numa_node": node,
        "ceiling_gbps": {d.value: round(g, 2) for d, g in s.ceilings.items()},
    }


def metadata(s: Setup, ranks: list[dict]) -> dict:
    """`bench transfer`'s metadata of rank 0's run, with `gpus` and each rank's device, node, ceiling."""
    meta = transfer.metadata(s.cfg, s.ceilings, s.layer_bytes)
    meta["gpus"] = len(ranks)
    meta["ranks"] = ranks
    meta["timing"] = (
        f"the planned path; median of {s.cfg.repeats} samples of {s.cfg.batch} back-to-back calls on the "
        "host clock, to the device synchronised; alone: rank after rank; together: from a common start, "
        "the earliest rank's start to the last rank's end"
    )
    return meta


def as_json(rows: list[GpusRow], meta: dict) -> dict:
    """The report `--json` writes: `{"meta": ..., "rows": [...]}`, each row's ranks a list of dicts."""
    return {"meta": meta, "rows": [asdict(r) for r in rows]}


def render(rows: list[GpusRow], meta: dict) -> Group:
    """The table `kvtier bench transfer --gpus N` prints: a row per direction, host set and device set."""
    where = ", ".join(
        f"{r['device']} {r['name']}" + ("" if r["numa_node"] is None else f" (node {r['numa_node']})")
        for r in meta["ranks"]
    )
    layers = "one layer" if meta["layers"] == 1 else f"{meta['layers']} layers per call"
    title = (
        f"{meta['spec']}, {layers} of {meta['tokens']} tokens ({meta['layer_bytes'] / 1e6:.0f} MB per call "
        f"per GPU), {meta['layout']}, page {meta['page_size']}, {meta['gpus']} GPUs at once: {where}"
    )
    table = Table(title=title)
    cols = (
        "direction",
        "host slots",
        "runs",
        "device",
        "path",
        "one GPU GB/s",
        "aggregate GB/s",
        "x one GPU",
    )
    right = {"runs", "one GPU GB/s", "aggregate GB/s", "x one GPU", "of ceiling"}
    for col in (*cols, "of ceiling", "ok"):
        table.add_column(col, justify="right" if col in right else "left")
    for r in rows:
        table.add_row(
            r.direction,
            r.host_runs,
            str(r.host_run_count),
            r.device,
            r.path,
            f"{r.one_gpu_gbps:.1f}",
            f"{r.aggregate_gbps:.1f}",
            f"{r.aggregate_ratio:.2f}",
            " ".join(f"{k.ceiling_ratio:.2f}" for k in r.ranks),
            "yes" if r.identical else "[red]NO[/red]",
        )
    note = (
        "one GPU: the mean of each rank alone; x one GPU: aggregate over it; of ceiling: each rank's rate "
        "together over its own ceiling; ok: byte-identical on every rank"
    )
    return Group(table, note)


def devices_for(gpus: int, device: str) -> list[torch.device]:
    """`cuda:0..gpus-1` for `--gpus` and `--device`; `ConfigError`, before anything is allocated, for
    fewer than one GPU, the CPU, one device named by index, or more GPUs than this machine has."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if device == "cpu":
        raise ConfigError(f"--gpus {gpus} needs CUDA devices, got --device cpu")
    if device not in ("auto", "cuda"):
        raise ConfigError(
            f"--gpus {gpus} runs on cuda:0..{gpus - 1}: give --device cuda or auto, not {device}"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > count:
        raise ConfigError(f"--gpus {gpus}: this machine has {count} CUDA device(s)")
    return [torch.device("cuda", i) for i in range(gpus)]
