"""`kvtier bench transfer`: the planner against each mechanism forced, at every fragmentation and size.

For one layer of a prefix of each `tokens` value it builds host slot sets from one run to fully
scattered (and after fill/evict churn of each allocator policy), device slots contiguous or
scattered, and times, in each direction, the planner's choice and each mechanism forced (the
kernel, the copy engine; optionally a stock-style kernel and the reference path). The ceiling is
one contiguous pinned copy of the same bytes, measured in the same run. Every timed variant is first
checked byte for byte: its target rows are poisoned with the complement of the right bytes, and
afterwards the whole destination layer must equal what it held before with exactly the targets
replaced by their sources. `cells` says per cell which variant was best and by how much.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvtier.alloc import AllocPolicy
from kvtier.bench.churn import after_churn, runs_of
from kvtier.bench.common import Timer, ceiling_gbps
from kvtier.bench.transfer_meta import STOCK_KERNEL, metadata
from kvtier.bench.transfer_sets import DEFAULT_VARIANTS, HOST_SETS, is_runs
from kvtier.errors import ConfigError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.pool.rows import as_words
from kvtier.spec import KVSpec
from kvtier.transfer import (
    KernelOptions,
    PathCosts,
    TransferPath,
    TransferPlan,
    backup,
    kernels,
    load_layers,
    probe,
)
from kvtier.transfer.options import MeasuredCosts
from kvtier.transfer.parts import CopyPart, KernelPart

# Copies issued one by one from Python (no batched call: the CPU) take seconds past this many.
MAX_PYTHON_COPIES = 4096
# A variant slower than this per call is timed 3 times, one call each.
SLOW_CALL_S = 0.02
# Calls per timed sample at least fill this long on the device, up to `MAX_BATCH` calls.
MIN_SAMPLE_S = 1e-3
MAX_BATCH = 16


@dataclass
class BenchConfig:
    spec: KVSpec
    tokens: int
    layout: HostLayout
    device: torch.device
    repeats: int
    warmup: int
    cycles: int
    batch: int = 4
    host_sets: tuple[str, ...] = HOST_SETS
    device_sets: tuple[str, ...] = ("contiguous", "scattered")
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    directions: tuple[Direction, ...] = (Direction.LOAD, Direction.BACKUP)
    kernel: KernelOptions = field(default_factory=KernelOptions)
    # Extra kernel shapes (budget, rows, stages) timed on the fully scattered set.
    kernel_sweep: tuple[KernelOptions, ...] = ()
    seed: int = 0
    # Slots of the host pool the sets are drawn from (None: 2 x `tokens`): a production pool's
    # span per layer, for the kernel's wide grids (`kernels.WIDE_SPAN_BYTES`).
    host_slots: int | None = None

    # Layers each timed call moves (`load_layers` / `backup` of layers 0..layers-1).
    layers: int = 1

    def __post_init__(self) -> None:
        bad = [name for name in self.host_sets if name not in HOST_SETS and not is_runs(name)]
        if bad:
            raise ConfigError(f"unknown host slot set(s) {bad}; known: {HOST_SETS} and runs-N for N >= 1")
        if self.host_slots is not None and self.host_slots < self.tokens:
            raise ConfigError(f"host_slots {self.host_slots} must be at least tokens {self.tokens}")

    @property
    def pool_slots(self) -> int:
        """The host pool's slots."""
        return self.host_slots or 2 * self.tokens


@dataclass
class Row:
    direction: str
    path: str
    variant: str
    planned: bool
    host_runs: str
    host_run_count: int
    device: str
    tokens: int
    nbytes: int
    sms: int
    kernel: str
    ms: float
    gbps: float
    ceiling_ratio: float
    identical: bool
    # Per buffer, the rows each mechanism moves.
    mechanisms: dict = field(default_factory=dict)
    # The variant of the same cell whose plan this one's is, and whose time it took ("": timed).
    same_plan_as: str = ""
    # The host's time to issue one call (`Timer.issue_ms`): where it passes `ms`, a reload of many
    # layers would wait for the host, not the link.
    issue_ms: float = 0.0


@dataclass
class Setup:
    """The pools, streams and slot sets one run times."""

    cfg: BenchConfig
    host: HostPool
    dev: DevicePool
    stream: torch.cuda.Stream | None
    timer: Timer
    layer_bytes: int
    ceilings: dict[Direction, float]
    host_sets: dict[str, torch.Tensor]
    dev_sets: dict[str, torch.Tensor]
    costs: MeasuredCosts | None  # the planned variant's (measured on CUDA); `fixed` has `PathCosts()`


def setup(cfg: BenchConfig, progress: Callable[[str], None]) -> Setup:
    spec = cfg.spec
    if not 1 <= cfg.layers <= spec.num_layers:  # before any pool is pinned
        raise ConfigError(f"layers {cfg.layers} must be in [1, {spec.num_layers}] for spec {spec.name!r}")
    gen = torch.Generator().manual_seed(cfg.seed)
    host_slots = cfg.pool_slots
    dev_slots = 2 * cfg.tokens
    progress(f"pinning a host pool of {host_slots} slots")
    host = HostPool(spec, host_slots, cfg.layout)
    dev = DevicePool(spec, dev_slots, cfg.device)
    _fill_random(host, dev, gen)
    stream = torch.cuda.Stream(cfg.device) if cfg.device.type == "cuda" else None
    timer = Timer(cfg.device, stream)
    # Bytes of one timed call: every buffer of the layers it moves.
    layer_bytes = cfg.tokens * sum(spec.layer_bytes_per_token(layer) for layer in range(cfg.layers))
    ceilings = {
        d: ceiling_gbps(cfg.device, layer_bytes, d, cfg.repeats, cfg.warmup, cfg.batch)
        for d in cfg.directions
    }
    progress("ceilings: " + ", ".join(f"{d.value} {g:.1f} GB/s" for d, g in ceilings.items()))

    host_sets = {}
    for name in cfg.host_sets:
        if name == "contiguous":
            host_sets[name] = torch.arange(cfg.tokens // 2, cfg.tokens // 2 + cfg.tokens)
        elif is_runs(name):
            length = max(int(name.removeprefix("runs-")), spec.page_size)
            host_sets[name] = runs_of(length, cfg.tokens, host_slots, gen)
        else:  # a churn set (`BenchConfig` refuses other names)
            policy = AllocPolicy(name.removesuffix("-churn"))
            progress(f"{cfg.cycles} fill/evict cycles with the {policy.value} allocator")
            host_sets[name] = after_churn(
                policy, cfg.tokens, host_slots, spec.page_size, cfg.cycles, cfg.seed
            )
    dev_sets = {}
    for name in cfg.device_sets:
        if name == "contiguous":
            dev_sets[name] = torch.arange(cfg.tokens)
        elif name == "scattered":
            # Whole pages in random order, as a paged device allocator hands them out.
            ps = spec.page_size
            pages = torch.randperm(dev_slots // ps, generator=gen)[: cfg.tokens // ps]
            dev_sets[name] = (pages[:, None] * ps + torch.arange(ps)).flatten()
        else:
            raise ConfigError(f"unknown device slot set {name!r}")
    costs = probe.measured_costs(cfg.device)
    if costs is not None:
        progress(f"planner costs measured: {costs.evidence}")
    return Setup(cfg, host, dev, stream, timer, layer_bytes, ceilings, host_sets, dev_sets, costs)


def run(cfg: BenchConfig, progress: Callable[[str], None] = lambda _msg: None) -> tuple[list[Row], dict]:
    """Run the benchmark; returns the rows and the run's metadata (ceilings, versions)."""
    s = setup(cfg, progress)
    rows: list[Row] = []
    for direction in cfg.directions:
        for host_label, hs in s.host_sets.items():
            for dev_label, ds in s.dev_sets.items():
                planned = TransferPlan.build(
                    direction, s.host, s.dev, hs, ds, costs=s.costs, kernel=cfg.kernel, stream=s.stream
                )
                plans = []
                for variant, path, opts in _variants(cfg, planned, host_label):
                    if variant == "planned":  # the planner's own plan, already built
                        plan = planned
                    elif variant == "fixed":  # the planner with the fixed costs
                        plan = TransferPlan.build(
                            direction, s.host, s.dev, hs, ds, costs=PathCosts(), kernel=opts, stream=s.stream
                        )
                    else:
                        plan = TransferPlan.build(
                            direction, s.host, s.dev, hs, ds, force=path, kernel=opts, stream=s.stream
                        )
                    plans.append((variant, plan))
                progress(f"{direction.value} {host_label} / device {dev_label}: {len(plans)} variants")
                rows += _time_cell(s, plans, host_label, dev_label)
    meta = metadata(cfg, s.ceilings, s.layer_bytes)
    meta["costs"] = None if s.costs is None else s.costs.evidence
    return rows, meta


def _variants(
    cfg: BenchConfig, planned: TransferPlan, host_label: str
) -> list[tuple[str, TransferPath | None, KernelOptions]]:
    """`(variant, path to force or None for the planner's, kernel options)` worth timing."""
    cuda = cfg.device.type == "cuda"
    kernel_ok = kernels.runs_on(cfg.device) and (cuda or planned.num_tokens <= 4096)
    out: list[tuple[str, TransferPath | None, KernelOptions]] = []
    for v in cfg.variants:
        if v in ("planned", "fixed"):
            out.append((v, None, cfg.kernel))
            continue
        path = TransferPath.KERNEL if v == "stock" else TransferPath(v)
        if path is TransferPath.COPY and not cuda and planned.joint_runs > MAX_PYTHON_COPIES:
            continue
        if path is TransferPath.KERNEL and not kernel_ok:
            continue
        if path is TransferPath.REFERENCE and host_label not in ("runs-1", "contiguous"):
            continue
        out.append((v, path, STOCK_KERNEL if v == "stock" else cfg.kernel))
    if host_label == "runs-1" and kernel_ok:
        for opts in cfg.kernel_sweep:
            stages = f"s{opts.stages}" if opts.stages else ""
            name = f"kernel-{opts.sm_budget}x{opts.rows_per_program or 'auto'}{stages}"
            out.append((name, TransferPath.KERNEL, opts))
    return out


def _time_cell(s: Setup, plans: list[tuple[str, TransferPlan]], host_label: str, dev_label: str) -> list[Row]:
    """Check every variant of one cell, then time its distinct plans round-robin, a sample of each in
    turn, so a slow spell of the machine weighs on all of them alike, every one in batches of the
    same length; a variant whose plan is another's (`plan_key`) takes that one's time. A row per
    variant."""
    checked = [check_plan(s, plan) for _, plan in plans]
    keys = [plan_key(plan) for _, plan in plans]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}  # the first variant of each plan
    timed = sorted(set(first.values()))
    ops = {i: plan_op(plans[i][1], s.host, s.dev, s.stream, s.cfg.layers) for i in timed}
    for op in ops.values():
        s.timer.median_ms(op, 1, 0)  # warm: the first launch of a plan compiles or binds its kernel
    once = {i: s.timer.median_ms(op, 1, 0) / 1e3 for i, op in ops.items()}
    issued = {i: s.timer.issue_ms(op) for i, op in ops.items()}
    # Short calls are timed in longer batches, so a launch's ramp and tail weigh as in a reload.
    fastest = min((t for t in once.values() if t <= SLOW_CALL_S), default=SLOW_CALL_S)
    batch = max(s.cfg.batch, min(MAX_BATCH, math.ceil(MIN_SAMPLE_S / max(fastest, 1e-6))))
    samples: dict[int, list[float]] = {i: [] for i in timed}
    for _ in range(s.cfg.repeats):
        for i, op in ops.items():
            slow = once[i] > SLOW_CALL_S
            if slow and len(samples[i]) >= 3:
                continue
            samples[i].append(s.timer.median_ms(op, 1, 0, 1 if slow else batch))
    rows = []
    for (variant, plan), key, ok in zip(plans, keys, checked, strict=True):
        i = first[key]
        row = _row(s, plan, variant, statistics.median(samples[i]), ok, host_label, dev_label)
        row.same_plan_as = "" if plans[i][0] == variant else plans[i][0]
        row.issue_ms = round(issued[i], 4)
        rows.append(row)
    return rows


def plan_key(plan: TransferPlan) -> tuple:
    """What executing `plan` does, for telling plans of one cell apart: per part its mechanism,
    buffers and rows, a copy part's streams and runs, a kernel part's units and launch shapes."""
    out: list[tuple] = []
    for p in plan.parts:
        key: tuple = (p.mechanism.value, tuple(sorted(p.buffers)), p.rows)
        if isinstance(p, CopyPart):
            key += (p.batched, p.streams, p.runs.table.tobytes())
        elif isinstance(p, KernelPart):
            key += tuple(
                (name, k.unit, tuple((launch.n, repr(launch.shape)) for launch in k.launches))
                for name, k in sorted(p.by_buffer.items())
            )
        out.append(key)
    return (plan.direction, tuple(out))


def _row(
    s: Setup, plan: TransferPlan, variant: str, ms: float, identical: bool, host_label: str, dev_label: str
) -> Row:
    gbps = s.layer_bytes / ms / 1e6
    uses_kernel = plan.sms_used > 0
    return Row(
        direction=plan.direction.value,
        path=plan.path.value,
        variant=variant,
        planned=variant == "planned",
        host_runs=host_label,
        host_run_count=plan.host_runs,
        device=dev_label,
        tokens=plan.num_tokens,
        nbytes=s.layer_bytes,
        sms=plan.sms_used,
        kernel=f"{plan.kernel.sm_budget}x{plan.kernel.rows_per_program or 'auto'}" if uses_kernel else "",
        ms=round(ms, 4),
        gbps=round(gbps, 2),
        ceiling_ratio=round(gbps / s.ceilings[plan.direction], 3),
        identical=identical,
        mechanisms=plan.mechanisms_by_buffer(),
    )


def plan_op(
    plan: TransferPlan, host: HostPool, dev: DevicePool, stream, layers: int = 1
) -> Callable[[], None]:
    """One timed call of `plan`: `load_layers` or `backup` of layers `0..layers-1` on `stream`."""
    if plan.direction is Direction.LOAD:
        return lambda: load_layers(plan, host, dev, range(layers), stream)
    return lambda: backup(plan, dev, host, range(layers), stream)


def _fill_random(host: HostPool, dev: DevicePool, gen: torch.Generator) -> None:
    for b in host.spec.buffers:
        for chunk in host.chunks(b.name):
            raw = chunk.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        for layer in b.layers:
            t = dev.layer(b.name, layer).view(torch.uint8)
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen).to(t.device))


def check_plan(s: Setup, plan: TransferPlan) -> bool:
    """Run the plan once; each destination layer must change in exactly the target rows, to the sources.

    Target rows are first set to the complement of their source, so a row the plan
    fails to write cannot pass by holding the right bytes already.
    """
    host, dev = s.host, s.dev
    hs, ds = plan.host_slots, plan.device_slots
    targets = [(b, layer) for layer in range(s.cfg.layers) for b in host.spec.buffers_on(layer)]
    every = torch.arange(host.num_slots)
    expect = []
    for b, layer in targets:
        dev_w = as_words(dev.layer(b.name, layer))
        if plan.direction is Direction.LOAD:
            src = as_words(host.gather(b.name, layer, hs)).to(dev_w.device)
            dev_w[ds.to(dev_w.device)] = ~src
            before = dev_w.clone()
            before[ds.to(dev_w.device)] = src
        else:
            src = dev_w[ds.to(dev_w.device)].cpu()
            host.scatter(b.name, layer, hs, _rows(~src, b))
            before = as_words(host.gather(b.name, layer, every))
            before[hs] = src
        expect.append(before)
    plan_op(plan, host, dev, s.stream, s.cfg.layers)()
    if dev.device.type == "cuda":
        torch.cuda.synchronize(dev.device)
    ok = True
    for (b, layer), want in zip(targets, expect, strict=True):
        if plan.direction is Direction.LOAD:
            ok &= torch.equal(as_words(dev.layer(b.name, layer)), want)
        else:
            ok &= torch.equal(as_words(host.gather(b.name, layer, every)), want)
    return bool(ok)


def _rows(words: torch.Tensor, b) -> torch.Tensor:
    return words.view(torch.uint8).view(b.dtype).view(words.shape[0], *b.row_shape)


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
