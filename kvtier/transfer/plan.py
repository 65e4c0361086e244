"""Transfer plans: decided once per operation, on CPU indices, before any layer moves.

A plan pairs host slots with device slots (`host_slots[i]` <-> `device_slots[i]`),
validates them, splits the pair lists into runs and assigns every row to one
mechanism. Every buffer of the spec and every layer reuses the same plan, so the
MLA latent and the DSA indexer of a token always move together. Building a plan is
the only place where indices are inspected: executing it never reads a device
tensor back to the host, and every index it needs on the device is uploaded once,
here, ordered by the plan's `ready` event.

Runs:
- a host run is a maximal stretch of the list where the host slot goes up by one
  and stays inside one host segment (rows contiguous in host memory);
- a joint run also needs the device slot to go up by one.

Mechanisms (a plan is one or more `Part`s, each with one mechanism):
- `COPY`: the copy engine, one copy per joint run: a single copy, a loop of copies
  (`PER_RUN`), or one `cudaMemcpyBatchAsync` per buffer and layer (`BATCHED_DMA`).
  No SMs; fast for long runs only.
- `STAGED`: host runs copied back to back into a device staging buffer by the copy
  engine (one batched call per window where many), then one on-device `index_copy_`
  (load) or `index_select` (backup) places the rows: long host runs onto scattered
  device slots, with no SMs held while the link is busy.
- `KERNEL`: a Triton kernel reading or writing pinned host memory directly, with
  `sm_budget` programs and many rows in flight each; any fragmentation, few SMs.
- `REFERENCE`: per-token gather and scatter through host memory; always correct,
  slow, and on CUDA it synchronises the host.

The planner: one joint run is a single copy; a host slab with scattered device
slots is staged; otherwise, where the kernel can run (CUDA and Triton), long joint
runs go to batched DMA, long host runs whose device slots are scattered to staging
(loads only), and the remaining rows to the kernel (`MIXED` when more than one of these); without
the kernel it takes the cheapest of per-run copies, staging and the reference path
by `PathCosts`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvtier.errors import PlanError, SlotError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostLayout, HostPool
from kvtier.slots import as_slot_tensor
from kvtier.spec import KVSpec
from kvtier.transfer import dma, kernels

# `(first slot, length)` runs of slots, in plan order (as the allocators hand them out).
Runs = list[tuple[int, int]]
# `(host runs, device runs)` of one operation.
RunPair = tuple[Runs, Runs]


class TransferPath(str, Enum):
    """What a plan does as a whole (for logs, benchmarks and `force`)."""

    SINGLE_COPY = "single_copy"
    PER_RUN = "per_run"
    BATCHED_DMA = "batched_dma"
    STAGED = "staged"
    KERNEL = "kernel"
    MIXED = "mixed"
    REFERENCE = "reference"


class Mechanism(str, Enum):
    """How one part of a plan moves its rows."""

    COPY = "copy"
    STAGED = "staged"
    KERNEL = "kernel"
    REFERENCE = "reference"


@dataclass(frozen=True)
class PathCosts:
    """What the planner assumes each mechanism costs (defaults measured on an H200, PCIe Gen5).

    `copy_issue_s`: host time to issue one copy from Python; `copy_gbps`: the copy
    engine between pinned host memory and the device; `device_gbps`: an on-device
    `index_copy_` of rows; `reference_gbps`: the per-token path through host memory;
    `copy_min_bytes`: a joint run at least this long goes to the copy engine when the
    kernel takes the rest; `staged_min_bytes`: a host run at least this long whose
    device slots are scattered is loaded through staging then (runs of 74 KB: 0.95 of
    the line rate against the kernel's 0.92; backups keep the kernel, whose scatter
    is faster than staging there); `copy_streams`: batched copies of one layer are spread over
    this many streams, so several copy engines overlap their per-copy cost. On an
    H200, runs of 74 KB reach 0.92-0.95 of the line rate that way in either direction
    (8 streams), as much as the kernel's best or more, and take no SMs; runs of 18 KB
    only 0.41 (bench/NOTES.md). `fan_out_below_bytes`: joint runs averaging at least
    this long stay on one stream: a copy's fixed cost (under 1 us) is then a few
    percent of it, while fanning out costs two event calls per side stream and layer.
    """

    copy_issue_s: float = 11e-6
    copy_gbps: float = 54.0
    device_gbps: float = 1200.0
    reference_gbps: float = 3.0
    copy_min_bytes: int = 64 << 10
    staged_min_bytes: int = 64 << 10
    copy_streams: int = 8
    fan_out_below_bytes: int = 1 << 20

    def estimate(self, mechanism: Mechanism, nbytes: int, copies: int) -> float:
        """Seconds to move `nbytes` of one layer with `copies` copy-engine copies."""
        if mechanism is Mechanism.REFERENCE:
            return self.copy_issue_s + nbytes / (self.reference_gbps * 1e9)
        t = copies * self.copy_issue_s + nbytes / (self.copy_gbps * 1e9)
        if mechanism is Mechanism.STAGED:
            t += self.copy_issue_s + nbytes / (self.device_gbps * 1e9)
        return t


@dataclass(frozen=True)
class KernelOptions:
    """The gather/scatter kernel's budget and shape.

    Up to `sm_budget` programs with `rows_per_program` rows per tile each (None: by row
    size, see `kernels.rows_in_flight`) and up to `stages` tiles in flight each (None: as
    many as the device's shared memory holds, up to `kernels.MAX_STAGES`; 1: no
    pipelining; only loads of rows that are whole 128-byte lines are pipelined); runs are
    moved in units of up to `max_unit_bytes` (one "row" of the kernel). With `lean` (and
    rows chosen by size), rows of `kernels.LEAN_ROW_BYTES` or more take only the programs
    that keep ~512 KiB in flight (2 pipelined, 4 not): they fill the link as 8 programs do,
    and the model beside keeps the other SMs (`kernels.programs_for`). `launch` gives one
    launch's shape.
    """

    sm_budget: int = 8
    rows_per_program: int | None = None
    max_unit_bytes: int = 16 << 10
    lean: bool = True
    stages: int | None = None

    def launch(
        self,
        row_bytes: int,
        align_bytes: int = kernels.LINE_BYTES,
        device: torch.device | None = None,
        direction: Direction = Direction.LOAD,
    ) -> KernelLaunch:
        """The launch for rows of `row_bytes` at offsets that are multiples of `align_bytes` on
        `device`, moved in `direction` (only loads are pipelined).

        `device` None or the CPU: planned as for a GPU whose shared memory holds every stage.
        """
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _launch(self, row_bytes, align_bytes, device, direction is Direction.LOAD)


@dataclass(frozen=True)
class KernelLaunch:
    """One launch's shape: `programs` (SMs), `rows` per tile, `stages` tiles in flight per program."""

    programs: int
    rows: int
    stages: int


@functools.lru_cache(maxsize=256)
def _launch(
    opts: KernelOptions, row_bytes: int, align_bytes: int, device: torch.device | None, gather: bool
) -> KernelLaunch:
    """`KernelOptions.launch`, kept per argument set: a reload asks it once per layer and buffer."""
    stages = kernels.stages_for(row_bytes, align_bytes, device, opts.stages, gather)
    if opts.rows_per_program is not None or not opts.lean:
        programs = opts.sm_budget
    else:
        programs = kernels.programs_for(row_bytes, opts.sm_budget, stages)
    rows = opts.rows_per_program or kernels.rows_in_flight(row_bytes, programs, stages)
    return KernelLaunch(programs, rows, stages)


@dataclass(frozen=True)
class Piece:
    """A contiguous stretch of the pair list: `length` rows from list position `pos`.

    Host slots `[host, host + length)` are contiguous in one host segment; for joint
    pieces device slots `[device, device + length)` are contiguous too.
    """

    pos: int
    host: int
    device: int
    length: int


@dataclass(frozen=True)
class KernelRows:
    """The kernel's rows of one buffer in one host region, as word offsets on the device.

    `src`/`dst`: `[m]` int64 word offsets (host rows from the region's start of a
    layer, device rows from the layer tensor's start), already swapped for backups.
    `word`: bytes per word of the offsets, the widest that the unit size and every
    offset allow (so the kernel need not rescale them on the device per launch);
    `align`: a power of two (in words) that divides every offset, found on the CPU,
    so the kernel picks its vector width without checking offsets on the GPU.
    """

    region: int
    src: torch.Tensor
    dst: torch.Tensor
    align: int = 1
    word: int = 1


@dataclass(frozen=True)
class Part:
    """Rows of a plan that one mechanism moves.

    `pieces`: joint runs (`COPY`) or host runs cut at staging windows (`STAGED`).
    `positions`: `[m]` int64 list positions (`REFERENCE`; for `KERNEL` the first row
    of each unit of `unit` rows). `device_index`: device slots on the device
    (`STAGED`: in piece order; `REFERENCE`: of `positions`). `kernel_rows`: per buffer
    name, the kernel's offsets per host region. `run_bytes`: per buffer name, `(host
    region, byte offset in it, device byte offset, bytes)` of each piece (`[pieces]`
    int64 numpy arrays; for `STAGED` the device offset is into the staging window).
    `windows`: `STAGED` only, `(first row, end row, first piece, end piece)` of each
    staging window, in the part's row order. `streams`: how many streams a batched
    part's copies of one layer are spread over. `programs`: `KERNEL` only, the largest
    grid of the part's launches (SMs held while it runs). `layer_tables`: `KERNEL` only,
    per buffer whose units are contiguous across layers on the host (`page_first`,
    whole pages), `(word, [layers] int64 on the device)`: each layer tensor's offset in
    words of `word` bytes from the first layer's, so that several layers move in one
    launch (`groups.copy_groups`).
    """

    mechanism: Mechanism
    rows: int
    pieces: tuple[Piece, ...] = ()
    positions: torch.Tensor | None = None
    device_index: torch.Tensor | None = None
    kernel_rows: dict[str, tuple[KernelRows, ...]] = field(default_factory=dict)
    batched: bool = False
    run_bytes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    unit: int = 1
    streams: int = 1
    windows: tuple[tuple[int, int, int, int], ...] = ()
    programs: int = 0
    layer_tables: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True)
class TransferPlan:
    """One operation's slot pairs, their runs and the parts that move them.

    `host_slots`, `device_slots`: `[n]` int64 on CPU. `ready`: a CUDA event after the
    plan's index uploads (None on CPU); executors make their stream wait on it.
    `host_pool`, `device_pool`: the pools it was planned for; executors refuse others.
    """

    direction: Direction
    path: TransferPath
    parts: tuple[Part, ...]
    host_slots: torch.Tensor
    device_slots: torch.Tensor
    host_runs: int
    device_runs: int
    joint_runs: int
    kernel: KernelOptions
    ready: torch.cuda.Event | None
    host_pool: HostPool = field(repr=False, compare=False)
    device_pool: DevicePool = field(repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.host_slots.numel())

    @property
    def sms_used(self) -> int:
        """SMs the plan takes from the model while it runs: the largest grid of its kernel launches."""
        return max((p.programs for p in self.parts if p.mechanism is Mechanism.KERNEL), default=0)

    def rows_by_mechanism(self) -> dict[str, int]:
        """Rows each mechanism moves (multiply by a layer's row bytes for bytes)."""
        out: dict[str, int] = {}
        for p in self.parts:
            out[p.mechanism.value] = out.get(p.mechanism.value, 0) + p.rows
        return out

    def describe(self) -> str:
        mechs = ", ".join(f"{m} {r}" for m, r in self.rows_by_mechanism().items())
        return (
            f"{self.direction.value} {self.num_tokens} tokens via {self.path.value} ({mechs} rows; "
            f"{self.sms_used} SMs): {self.host_runs} host runs, {self.device_runs} device runs, "
            f"{self.joint_runs} joint runs"
        )

    @classmethod
    def build(
        cls,
        direction: Direction | str,
        host_pool: HostPool,
        device_pool: DevicePool,
        host_slots: torch.Tensor | Sequence[int],
        device_slots: torch.Tensor | Sequence[int],
        *,
        costs: PathCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | str | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """Validate the pairs and plan the operation: `Planner(...).plan(...)`; raises before anything
        is written. See `Planner`."""
        planner = Planner(host_pool, device_pool, costs, kernel, force)
        return planner.plan(direction, host_slots, device_slots, stream)

    def check_pools(self, host_pool: HostPool, device_pool: DevicePool) -> None:
        """Raise `PlanError` unless these are the pools the plan was built for."""
        if host_pool is not self.host_pool or device_pool is not self.device_pool:
            raise PlanError(
                f"the plan was built for {self.host_pool} and {self.device_pool}, "
                f"not {host_pool} and {device_pool}"
            )


_COPY_PATHS = (TransferPath.SINGLE_COPY, TransferPath.PER_RUN, TransferPath.BATCHED_DMA)


def _check_options(
    host_pool: HostPool, device_pool: DevicePool, costs: PathCosts, kernel: KernelOptions
) -> None:
    hspec, dspec = host_pool.spec, device_pool.spec
    if hspec is not dspec and _shape_of(hspec) != _shape_of(dspec):
        raise PlanError(
            f"host pool spec {hspec.name!r} and device pool spec {dspec.name!r} "
            "have different buffers, layers or row shapes"
        )
    if kernel.sm_budget < 1 or any(v is not None and v < 1 for v in (kernel.rows_per_program, kernel.stages)):
        raise PlanError(f"kernel options must be positive, got {kernel}")
    if costs.copy_streams < 1:
        raise PlanError(f"copy_streams must be at least 1, got {costs.copy_streams}")


class Planner:
    """The planner's choices for one pool pair and one set of options, checked once.

    `costs` and `kernel` tune the planner; `force` picks one path instead (benchmarks and
    tests; `MIXED` cannot be forced, `SINGLE_COPY` only on one joint run, `KERNEL` needs
    Triton). `use_kernel` lets the planner use the kernel (default: on CUDA with Triton).
    A caller that plans many operations on the same pools (the cache) keeps one.
    """

    def __init__(
        self,
        host_pool: HostPool,
        device_pool: DevicePool,
        costs: PathCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | str | None = None,
        use_kernel: bool | None = None,
    ) -> None:
        self.costs = costs or PathCosts()
        self.kernel = kernel or KernelOptions()
        _check_options(host_pool, device_pool, self.costs, self.kernel)
        self.host_pool, self.device_pool = host_pool, device_pool
        self.force = None if force is None else TransferPath(force)
        cuda = device_pool.device.type == "cuda"
        self.kernel_ok = (cuda if use_kernel is None else use_kernel) and kernels.runs_on(device_pool.device)
        # Copy parts go out as batched calls (where a buffer has many runs) on CUDA with raw copies.
        self.batched = cuda and dma.dma_mode() is not dma.DmaMode.TORCH
        self.widest = host_pool.spec.widest_row_bytes

    def plan(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor | Sequence[int],
        device_slots: torch.Tensor | Sequence[int],
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """Validate the pairs and plan the operation; raises before anything is written.

        `host_slots`, `device_slots`: `[n]` integer slot ids, CPU (`kvtier.slots.as_slots`).
        For a load the device slots must be distinct, for a backup the host slots. On CUDA
        the device indices are uploaded on `stream`.
        """
        direction = Direction(direction)
        load = direction is Direction.LOAD
        h = as_slot_tensor("host_slots", host_slots, self.host_pool.num_slots, distinct=not load)
        d = as_slot_tensor("device_slots", device_slots, self.device_pool.num_slots, distinct=load)
        if h.numel() != d.numel():
            raise SlotError(f"host_slots has {h.numel()} entries but device_slots has {d.numel()}")
        return self._plan(direction, h, d, 1, stream)

    def plan_allocated(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        runs: RunPair | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """Plan an operation on slots from kvtier's allocators and tree, unchecked.

        `host_slots`, `device_slots`: `[n]` int64 CPU tensors, in range, the destinations
        distinct, both sides whole allocator pages (each page's slots consecutive from a
        page-aligned id), so runs are found per page, not per slot. `runs`: their `(host
        runs, device runs)`, each a list of `(first slot, length)` in plan order (as the
        allocators hand them out): a copy-engine plan is then built from the runs alone,
        without a pass over the slots. On CUDA the device indices are uploaded on `stream`.
        """
        direction = Direction(direction)
        if host_slots.numel() != device_slots.numel():
            raise SlotError(
                f"host_slots has {host_slots.numel()} entries but device_slots has {device_slots.numel()}"
            )
        n = host_slots.numel()
        if runs is not None:
            copies = self.copies(n, runs)
            if copies is not None:
                return TransferPlan(
                    direction=direction,
                    path=copies.path,
                    parts=(copies.part(),),
                    host_slots=host_slots,
                    device_slots=device_slots,
                    host_runs=copies.host_runs,
                    device_runs=copies.device_runs,
                    joint_runs=len(copies.lens),
                    kernel=self.kernel,
                    ready=None,
                    host_pool=self.host_pool,
                    device_pool=self.device_pool,
                )
        ps = self.host_pool.spec.page_size
        return self._plan(direction, host_slots, device_slots, ps if n % ps == 0 else 1, stream)

    def _plan(
        self,
        direction: Direction,
        h: torch.Tensor,
        d: torch.Tensor,
        step: int,
        stream: torch.cuda.Stream | None,
    ) -> TransferPlan:
        """The plan of valid pairs `h`, `d` (`[n]` int64 CPU), runs found per `step` slots."""
        host_pool, device_pool, costs, kernel = self.host_pool, self.device_pool, self.costs, self.kernel
        n = h.numel()
        widest, batched = self.widest, self.batched
        hn, dn = h.numpy(), d.numpy()
        host_break, dev_break = (
            _breaks(hn, step, host_pool.segment_slots, host_pool.num_slots),
            _breaks(dn, step),
        )
        host_starts, host_lens = _runs(host_break, step)
        joint_starts, joint_lens = _runs(host_break | dev_break, step)
        path = self.decide(
            n,
            len(host_starts),
            len(joint_starts),
            int((joint_lens * widest >= costs.copy_min_bytes).sum()),
        )

        up = _Uploader(device_pool.device, stream)
        js, jl = joint_starts, joint_lens
        cap = device_pool.staging_tokens
        if path in _COPY_PATHS:
            use_batch = batched and path is not TransferPath.PER_RUN
            streams = _copy_streams(host_pool.spec, n, len(jl), use_batch, costs)
            parts = (_copy_part(host_pool, js, hn[js], dn[js], jl, use_batch, streams),)
        elif path is TransferPath.STAGED:
            parts = (
                _staged_part(host_pool, hn, dn, host_starts, host_lens, cap, batched, costs.copy_streams, up),
            )
        elif path is TransferPath.KERNEL:
            parts = (
                _kernel_part(direction, host_pool, device_pool, hn, dn, joint_starts, joint_lens, kernel, up),
            )
        elif path is TransferPath.MIXED:
            # Backups keep the kernel for these rows: its scatter beats staging then copying out
            # (bench/NOTES.md).
            staged_min = costs.staged_min_bytes if direction is Direction.LOAD else None
            split = _Stretches.of(js, jl, host_break, step, widest, costs.copy_min_bytes, staged_min)
            parts = split.parts(direction, host_pool, device_pool, hn, dn, kernel, cap, batched, costs, up)
            path = _path_of(parts)
        else:
            parts = (Part(Mechanism.REFERENCE, len(hn), positions=torch.arange(len(hn)), device_index=up(d)),)
        return TransferPlan(
            direction=direction,
            path=path,
            parts=parts,
            host_slots=h,
            device_slots=d,
            host_runs=len(host_starts),
            device_runs=int(dev_break.sum()),
            joint_runs=len(joint_starts),
            kernel=kernel,
            ready=up.finish(),
            host_pool=host_pool,
            device_pool=device_pool,
        )

    def decide(self, n: int, host_runs: int, joint_runs: int, long_runs: int) -> TransferPath:
        """The path of an operation of `n` rows (`force`d, else `_choose`'s)."""
        if self.force is not None:
            return _forced(self.force, joint_runs, self.device_pool.device)
        return _choose(
            self.costs,
            nbytes=n * self.widest,
            host_runs=host_runs,
            joint_runs=joint_runs,
            windows=-(-n // self.device_pool.staging_tokens),
            kernel_ok=self.kernel_ok,
            long_runs=long_runs,
        )

    def copies(self, n: int, runs: RunPair) -> RunCopies | None:
        """The copy-engine plan of `n` allocated slots given as `runs` (see `plan_allocated`),
        or None where the planner picks another mechanism for some row."""
        host_pool = self.host_pool
        joint = _joint_runs(*runs, host_pool.segment_slots, host_pool.num_slots)
        lens = joint.lens
        if sum(lens) != n:
            raise PlanError(f"the runs cover {sum(lens)} slots, the plan has {n}")
        long_runs = sum(k * self.widest >= self.costs.copy_min_bytes for k in lens)
        path = self.decide(n, joint.host_runs, len(lens), long_runs)
        if path not in _COPY_PATHS:
            return None
        table = np.array((joint.pos, joint.host, joint.dev, lens), dtype=np.int64)
        batched = self.batched and path is not TransferPath.PER_RUN
        streams = _copy_streams(host_pool.spec, n, len(lens), batched, self.costs)
        return RunCopies(
            path, table, joint.host_runs, joint.device_runs, batched, streams, host_pool, self.device_pool
        )


@dataclass(frozen=True)
class RunCopies:
    """An operation that the copy engine moves whole, planned from run lists alone (`Planner.copies`).

    `joint`: `[4, R]` int64, C-contiguous: where each joint run starts in the plan, its
    first host slot, first device slot and length (host runs cut at segment edges).
    `batched`: copies go out as batched calls where a buffer has many runs; `streams`:
    how many streams one layer's copies are spread over (from `costs`). `host_pool`,
    `device_pool`: the planner's pools.
    """

    path: TransferPath
    joint: np.ndarray
    host_runs: int
    device_runs: int
    batched: bool
    streams: int
    host_pool: HostPool = field(repr=False, compare=False)
    device_pool: DevicePool = field(repr=False, compare=False)

    @property
    def lens(self) -> np.ndarray:
        return self.joint[3]

    def part(self) -> Part:
        """The plan's one part."""
        return _copy_part(self.host_pool, *self.joint, self.batched, self.streams)


@dataclass(frozen=True)
class _JointRuns:
    """Maximal joint runs found from run lists: starts in the plan, first host and device slot, lengths."""

    pos: list[int]
    host: list[int]
    dev: list[int]
    lens: list[int]
    host_runs: int
    device_runs: int


def _joint_runs(host: Runs, dev: Runs, segment: int, num_slots: int) -> _JointRuns:
    """The joint runs of two run lists (`(first slot, length)` in plan order), as a slot scan finds them.

    Adjacent runs merge; host runs also break at segment edges when the pool has
    more than one segment. O(runs) Python, no pass over the slots.
    """
    h, d = _merged(host), _merged(dev)
    if segment < num_slots:
        h = [(a + o, take) for a, n in h for o, take in _cut(a, n, segment)]
    if sum(n for _, n in h) != sum(n for _, n in d):
        raise PlanError(f"host runs cover {sum(n for _, n in h)} slots, device runs {sum(n for _, n in d)}")
    out: tuple[list[int], ...] = ([], [], [], [])
    i = j = at = hs = ds = hrem = drem = 0
    while i < len(h) or hrem:
        if hrem == 0:
            hs, hrem = h[i]
            i += 1
        if drem == 0:
            ds, drem = d[j]
            j += 1
        take = min(hrem, drem)
        for lst, v in zip(out, (at, hs, ds, take), strict=True):
            lst.append(v)
        at, hs, ds, hrem, drem = at + take, hs + take, ds + take, hrem - take, drem - take
    return _JointRuns(*out, host_runs=len(h), device_runs=len(d))


def _merged(runs: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def _cut(start: int, n: int, segment: int) -> list[tuple[int, int]]:
    """`(offset, length)` pieces of the run `[start, start + n)` that stay within one segment."""
    out, at = [], 0
    while at < n:
        take = min(n - at, segment - (start + at) % segment)
        out.append((at, take))
        at += take
    return out


def _forced(path: TransferPath, joint_runs: int, device: torch.device) -> TransferPath:
    if path is TransferPath.MIXED:
        raise PlanError("a mixed plan is the planner's choice; it cannot be forced")
    if path is TransferPath.SINGLE_COPY and joint_runs > 1:
        raise PlanError(f"cannot force a single copy over {joint_runs} joint runs")
    if path is TransferPath.KERNEL and not kernels.runs_on(device):
        raise PlanError(
            f"the kernel path needs Triton and a CUDA device pool (or TRITON_INTERPRET=1), not {device}"
        )
    return path


def _choose(
    costs: PathCosts,
    nbytes: int,
    host_runs: int,
    joint_runs: int,
    windows: int,
    kernel_ok: bool,
    long_runs: int,
) -> TransferPath:
    """The path for one operation; see the module docstring."""
    if joint_runs <= 1:
        return TransferPath.SINGLE_COPY
    if host_runs == 1:
        return TransferPath.STAGED
    if kernel_ok:
        # MIXED here means "split by run" (`_Stretches`); the plan's path follows its parts.
        return TransferPath.BATCHED_DMA if long_runs == joint_runs else TransferPath.MIXED
    estimates = {
        TransferPath.PER_RUN: costs.estimate(Mechanism.COPY, nbytes, joint_runs),
        TransferPath.STAGED: costs.estimate(Mechanism.STAGED, nbytes, host_runs + windows),
        TransferPath.REFERENCE: costs.estimate(Mechanism.REFERENCE, nbytes, 0),
    }
    return min(estimates, key=estimates.__getitem__)


def _copy_part(
    host_pool: HostPool,
    pos: np.ndarray,
    host_at: np.ndarray,
    dev_at: np.ndarray,
    lens: np.ndarray,
    batched: bool,
    streams: int,
) -> Part:
    """Copy-engine copies of joint runs, with their byte addresses per buffer (for raw submission).

    `pos`, `host_at`, `dev_at`, `lens`: `[runs]` int64, where each joint run starts
    in the plan, its first host and device slot, and its length. `streams`: how many
    streams a batched part's copies of one layer go over (`_copy_streams`).
    """
    return Part(
        Mechanism.COPY,
        int(lens.sum()),
        _pieces(pos, host_at, dev_at, lens),
        batched=batched,
        run_bytes=_run_bytes(host_pool, host_at, dev_at, lens),
        streams=streams,
    )


def _copy_streams(spec: KVSpec, rows: int, runs: int, batched: bool, costs: PathCosts) -> int:
    """Streams a copy part's copies of one layer go over: `rows` in `runs`.

    `costs.copy_streams` for batched copies of runs shorter on average than
    `PathCosts.fan_out_below_bytes`, else one.
    """
    if batched and runs and rows * spec.widest_row_bytes < costs.fan_out_below_bytes * runs:
        return costs.copy_streams
    return 1


def _run_bytes(
    host_pool: HostPool, host_at: np.ndarray, dev_at: np.ndarray, lens: np.ndarray
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """`Part.run_bytes` of runs: per buffer, `(host region, byte offset in it, device byte offset, bytes)`.

    `host_at`, `dev_at`, `lens`: `[runs]` int64 first host slot, first device row (a
    slot, or a row of the staging window) and length of each run.
    """
    out = {}
    for b in host_pool.spec.buffers:
        region, row = host_pool.locate(b.name, host_at)
        out[b.name] = (region, row * b.row_bytes, dev_at * b.row_bytes, lens * b.row_bytes)
    return out


@dataclass(frozen=True)
class _Stretches:
    """Joint runs sorted by mechanism: `[runs]` int64 list positions and lengths per class.

    `copy`: long joint runs (batched DMA straight to their device slots). `staged`:
    host runs of at least `staged_min_bytes` made of short joint runs (their device
    slots are scattered), as whole host runs. `kernel`: every other joint run.
    """

    copy: tuple[np.ndarray, np.ndarray]
    staged: tuple[np.ndarray, np.ndarray]
    kernel: tuple[np.ndarray, np.ndarray]

    @classmethod
    def of(
        cls,
        starts: np.ndarray,
        lens: np.ndarray,
        host_break: np.ndarray,
        step: int,
        widest: int,
        copy_min: int,
        staged_min: int | None,
    ) -> _Stretches:
        """Classify joint runs (`starts`, `lens` in list positions); `host_break` per `step` slots.

        `copy_min`, `staged_min`: the bytes (of the widest buffer) from which a joint run
        is copied, a host run staged (None: never).
        """
        long = lens * widest >= copy_min
        s, n = starts[~long], lens[~long]
        # A short joint run continues the previous one on the host side: same host run.
        cont = np.zeros(len(s), dtype=bool)
        if len(s) > 1:
            cont[1:] = (s[1:] == s[:-1] + n[:-1]) & ~host_break[s[1:] // step]
        heads = np.flatnonzero(~cont)
        rows = np.add.reduceat(n, heads) if len(heads) else n
        staged_run = rows * widest >= staged_min if staged_min is not None else np.zeros(len(rows), bool)
        staged = np.repeat(staged_run, np.diff(np.append(heads, len(s))))
        return cls(
            copy=(starts[long], lens[long]),
            staged=(s[heads][staged_run], rows[staged_run]),
            kernel=(s[~staged], n[~staged]),
        )

    def parts(
        self,
        direction: Direction,
        host_pool: HostPool,
        device_pool: DevicePool,
        hn: np.ndarray,
        dn: np.ndarray,
        kernel: KernelOptions,
        cap: int,
        batched: bool,
        costs: PathCosts,
        up: _Uploader,
    ) -> tuple[Part, ...]:
        out = []
        if len(self.copy[0]):
            s, n = self.copy
            streams = _copy_streams(host_pool.spec, int(n.sum()), len(n), batched, costs)
            out.append(_copy_part(host_pool, s, hn[s], dn[s], n, batched, streams))
        if len(self.staged[0]):
            out.append(_staged_part(host_pool, hn, dn, *self.staged, cap, batched, costs.copy_streams, up))
        if len(self.kernel[0]):
            out.append(_kernel_part(direction, host_pool, device_pool, hn, dn, *self.kernel, kernel, up))
        return tuple(out)


def _path_of(parts: tuple[Part, ...]) -> TransferPath:
    """The path a split plan reports: its one mechanism's, or `MIXED`."""
    if len(parts) != 1:
        return TransferPath.MIXED
    (p,) = parts
    if p.mechanism is Mechanism.COPY:
        return TransferPath.BATCHED_DMA if p.batched else TransferPath.PER_RUN
    return TransferPath.STAGED if p.mechanism is Mechanism.STAGED else TransferPath.KERNEL


def _staged_part(
    host_pool: HostPool,
    hn: np.ndarray,
    dn: np.ndarray,
    pos: np.ndarray,
    lens: np.ndarray,
    cap: int,
    batched: bool,
    streams: int,
    up: _Uploader,
) -> Part:
    """Host runs through the staging buffer of `cap` rows, cut where a window ends.

    `pos`, `lens`: `[runs]` int64 list positions and lengths of host runs (each
    contiguous in one host segment). The part's rows are the runs' rows in order; the
    device slots of those rows are uploaded once as `device_index`.
    """
    total = int(lens.sum())
    at = np.cumsum(lens) - lens  # each run's first row in the part
    cuts = np.union1d(at, np.arange(cap, total, cap))
    run = np.searchsorted(at, cuts, side="right") - 1
    off = cuts - at[run]
    sub_lens = np.diff(np.append(cuts, total))
    sub_pos = pos[run] + off
    host_at = hn[pos[run]] + off
    window = cuts // cap
    stage_row = cuts - window * cap
    first = np.flatnonzero(np.diff(window, prepend=-1))
    ends = np.append(first[1:], len(cuts))
    windows = tuple(
        (w * cap, min((w + 1) * cap, total), a, z)
        for w, a, z in zip(window[first].tolist(), first.tolist(), ends.tolist(), strict=True)
    )
    run_bytes = _run_bytes(host_pool, host_at, stage_row, sub_lens)
    rows = np.repeat(pos - at, lens) + np.arange(total)
    return Part(
        Mechanism.STAGED,
        total,
        _pieces(sub_pos, host_at, dn[sub_pos], sub_lens),
        device_index=up(torch.from_numpy(dn[rows])),
        batched=batched,
        run_bytes=run_bytes,
        streams=streams if batched else 1,
        windows=windows,
    )


def _kernel_part(
    direction: Direction,
    host_pool: HostPool,
    device_pool: DevicePool,
    hn: np.ndarray,
    dn: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    opts: KernelOptions,
    up: _Uploader,
) -> Part:
    """Word offsets for the kernel, per buffer and host region, uploaded once.

    Joint runs are cut into units of `unit` rows (the largest divisor of every run
    length within `KernelOptions.max_unit_bytes`), each contiguous on both sides, so
    the kernel moves fewer, wider rows when runs allow it: page-granular slots move
    whole pages. In the `page_first` layout, units of whole pages are also contiguous
    across layers on the host: such buffers get a layer table (see `Part`).
    """
    widest = host_pool.spec.widest_row_bytes
    unit = _unit(lens, max(1, opts.max_unit_bytes // widest))
    in_run = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    rows = np.repeat(starts, lens) + in_run
    rows = rows[in_run % unit == 0]
    per_buffer: dict[str, tuple[KernelRows, ...]] = {}
    for b in host_pool.spec.buffers:
        region, host_row = host_pool.locate(b.name, hn[rows])
        entries = []
        for r in np.unique(region).tolist():
            mask = region == r
            host_off = host_row[mask] * b.row_bytes
            dev_off = dn[rows][mask] * b.row_bytes
            src, dst = (host_off, dev_off) if direction is Direction.LOAD else (dev_off, host_off)
            align = kernels.common_alignment(src, dst)  # bytes
            word = kernels.word_size(b.row_bytes * unit, [align])
            src, dst = src // word, dst // word
            entries.append(
                KernelRows(
                    int(r), up(torch.from_numpy(src)), up(torch.from_numpy(dst)), max(1, align // word), word
                )
            )
        per_buffer[b.name] = tuple(entries)
    tables = {}
    if host_pool.layout is HostLayout.PAGE_FIRST and unit == host_pool.spec.page_size:
        for b in host_pool.spec.buffers:
            table = _layer_table(device_pool, b.name, per_buffer[b.name])
            if table is not None:
                tables[b.name] = (table[0], up(table[1]))
    # The launches' largest grid; a buffer's offsets are as aligned as its least aligned region's.
    aligns = {name: min(e.align * e.word for e in entries) for name, entries in per_buffer.items()}
    device = device_pool.device
    programs = max(
        opts.launch(b.row_bytes * unit, aligns[b.name], device, direction).programs
        for b in host_pool.spec.buffers
    )
    return Part(
        Mechanism.KERNEL,
        int(lens.sum()),
        positions=torch.from_numpy(rows),
        kernel_rows=per_buffer,
        unit=unit,
        programs=max(programs, opts.sm_budget) if tables else programs,
        layer_tables=tables,
    )


def _layer_table(
    device_pool: DevicePool, buffer: str, entries: tuple[KernelRows, ...]
) -> tuple[int, torch.Tensor] | None:
    """`(word, [layers] int64)`: each layer tensor's offset from the first in words, or None.

    None where layers cannot move together: a single layer, rows the raw paths cannot
    address, regions in words of different widths, or tensors not whole words apart.
    """
    ptrs = device_pool.layer_ptrs(buffer)
    words = {e.word for e in entries}
    if len(ptrs) < 2 or not device_pool.raw_rows(buffer) or len(words) != 1:
        return None
    word = words.pop()
    deltas = ptrs - ptrs[0]
    if np.any(deltas % word):
        return None
    return word, torch.from_numpy(deltas // word)


def _unit(lens: np.ndarray, cap: int) -> int:
    """The largest divisor of every run length that is at most `cap` rows."""
    g = int(np.gcd.reduce(lens)) if len(lens) else 1
    for u in range(min(g, cap), 0, -1):
        if g % u == 0:
            return u
    return 1


class _Uploader:
    """Copies CPU index tensors to the plan's device on one stream, then records `ready`."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device = device
        self.stream = stream
        if device.type == "cuda" and stream is None:
            self.stream = torch.cuda.current_stream(device)
        self.used = False

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        self.used = True
        with torch.cuda.stream(self.stream):
            return t.pin_memory().to(self.device, non_blocking=True)

    def finish(self) -> torch.cuda.Event | None:
        if not self.used:
            return None
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return ready


def _shape_of(spec: KVSpec) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(b.name, b.layers, b.row_shape) for b in spec.buffers]


def _breaks(slots: np.ndarray, step: int, segment: int | None = None, num_slots: int = 0) -> np.ndarray:
    """Where a run starts, per `step` slots: `[n // step]` bool.

    `slots`: `[n]` int64; with `step` > 1 every `step` consecutive slots are one page
    (consecutive ids), so only page heads are compared. A run also starts at a
    segment edge (`segment` slots, host side) when the pool has more than one.
    """
    heads = slots[::step] if step > 1 else slots
    out = np.ones(len(heads), dtype=bool)
    if len(heads) > 1:
        np.not_equal(np.diff(heads), step, out=out[1:])
        if segment is not None and segment < num_slots:
            out[1:] |= heads[1:] % segment == 0
    return out


def _runs(breaks: np.ndarray, step: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths, in slots, of the runs that `breaks` (`[n // step]` bool) delimits."""
    starts = np.flatnonzero(breaks)
    lens = np.diff(np.append(starts, len(breaks)))
    return starts * step, lens * step


def _pieces(pos: np.ndarray, host_at: np.ndarray, dev_at: np.ndarray, lens: np.ndarray) -> tuple[Piece, ...]:
    return tuple(
        Piece(p, h, d, n)
        for p, h, d, n in zip(pos.tolist(), host_at.tolist(), dev_at.tolist(), lens.tolist(), strict=True)
    )
