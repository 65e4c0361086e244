"""Transfer plans: decided once per operation, on CPU indices, before any layer moves.

A `Planner` holds one pool pair and one set of options, checked once. A plan pairs
`host_slots[i]` with `device_slots[i]`, finds their runs (`runs`) and gives every row to
one part (`parts`). Every buffer and layer reuses the same plan, so all buffers of a
token move together. Only planning inspects indices: every index the device needs is
uploaded once, here, ordered by the plan's `ready` event, and executing never reads a
device tensor back. A plan records its pools; the executors refuse others.

The choice: in `page_first`, for calls of several layers, a buffer's runs of whole pages move as
stacks where each is worth one copy (`stacks`). Of the rest, one joint run is a single copy; a
single host run with scattered device slots is staged; otherwise, where the kernel can run (CUDA
and Triton), each buffer is planned by its `costs.Choice` (the fixed thresholds of `PathCosts`,
or a measured `CostModel`): its long joint runs go to batched DMA, long host runs whose device
slots are scattered to staging by the copy engine, shorter ones of small rows to staging by the
kernel's units, and the remaining rows to the kernel; a buffer of small rows also stages by the copy
engine the host runs the widest buffer stages, where the copies stay long on average, and an
overlapped backup hands the copy engine a share of what the kernel moves alone (`splits`);
buffers whose runs split alike share their parts, and those that stage the same host runs their
staged part (`staging`). Without the kernel: the cheapest of per-run copies, staging and reference.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import PlanError, SlotError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostLayout, HostPool
from kvtier.slots import as_slot_tensor
from kvtier.transfer import calibrate, dma, kernels, options, parts, phases, splits, stacks, staging, units
from kvtier.transfer import runs as slot_runs
from kvtier.transfer.costs import Choice, CostModel
from kvtier.transfer.options import KernelOptions, Mechanism, PathCosts, TransferPath
from kvtier.transfer.parts import Buffers, CopyPart, Part, RunCopies, StagedPart, Uploader
from kvtier.transfer.runs import RunPair, RunTable

log = logging.getLogger(__name__)

_COPY_PATHS = (TransferPath.SINGLE_COPY, TransferPath.PER_RUN, TransferPath.BATCHED_DMA)
# `(starts, lengths)` of runs, `[k]` int64 positions and lengths each.
Runs = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Group:
    """One buffer as the planner sees it: its name, row bytes, `Choice` and the model layers it is on."""

    name: str
    row_bytes: int
    choice: Choice
    layers: frozenset[int]


@dataclass(frozen=True)
class TransferPlan:
    """One operation's slot pairs (`[n]` int64 CPU each), their runs and the parts that move them;
    `ready`: a CUDA event after the plan's index uploads (None on CPU), which executors wait on."""

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
    # The cost model whose choices made the plan ("defaults": `PathCosts`' fixed thresholds).
    cost_model: str = "defaults"
    # The layers of the calls the plan was made for (stacks' windows; any call moves every row).
    layers_per_call: int = 1

    @property
    def num_tokens(self) -> int:
        return int(self.host_slots.numel())

    @functools.cached_property
    def overlap(self) -> phases.Phases | None:
        """How each layer's parts run at once (`phases.phases`; None: in plan order), found once."""
        return phases.phases(self)

    @property
    def sms_used(self) -> int:
        """SMs the plan takes from the model while it runs: its kernels' grids at once (`phases`)."""
        return phases.sms_held(self.parts, self.overlap)

    def rows_by_mechanism(self) -> dict[str, int]:
        """Rows each mechanism moves, summed over parts (a part of some buffers counts its rows once)."""
        return dict(sum((Counter({p.mechanism.value: p.rows}) for p in self.parts), Counter()))

    def mechanisms_by_buffer(self) -> dict[str, dict[str, int]]:
        """Per buffer name, the rows each mechanism moves (`staged_kernel`: staging filled by the kernel)."""
        out: dict[str, dict[str, int]] = {b.name: {} for b in self.host_pool.spec.buffers}
        for p in self.parts:
            m = p.mechanism.value
            if parts.by_units(p):
                m = "staged_kernel"
            for name in p.buffers:
                out[name][m] = out[name].get(m, 0) + p.rows
        return out

    def describe(self) -> str:
        mechs = "; ".join(
            f"{name}: " + ", ".join(f"{m} {r}" for m, r in by.items())
            for name, by in self.mechanisms_by_buffer().items()
        )
        return (
            f"{self.direction.value} {self.num_tokens} tokens via {self.path.value} ({mechs} rows; "
            f"{self.sms_used} SMs; costs: {self.cost_model}): {self.host_runs} host runs, "
            f"{self.device_runs} device runs, {self.joint_runs} joint runs"
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
        layers_per_call: int = 1,
    ) -> TransferPlan:
        """`Planner(...).plan(...)`: one operation's plan."""
        planner = Planner(host_pool, device_pool, costs, kernel, force)
        return planner.plan(direction, host_slots, device_slots, stream, layers_per_call)


class Planner:
    """The planner's choices for one pool pair and one set of options, checked once.

    `force` picks one path instead of the planner (benchmarks and tests; not `MIXED`,
    `SINGLE_COPY` only on one joint run, `KERNEL` where it runs). `use_kernel` lets the
    planner use the kernel (default: on CUDA with Triton). `model`: measured costs to choose by
    (None: this GPU's calibration, measured at first use and cached, unless `KVTIER_CALIBRATION=off`;
    without it, or where it fails, `costs`' thresholds).
    """

    def __init__(
        self,
        host_pool: HostPool,
        device_pool: DevicePool,
        costs: PathCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | str | None = None,
        use_kernel: bool | None = None,
        model: CostModel | None = None,
    ) -> None:
        self.costs = costs or PathCosts()
        self.kernel = kernel or KernelOptions()
        options.check(host_pool, device_pool, self.costs, self.kernel)
        self.host_pool, self.device_pool = host_pool, device_pool
        self.force = None if force is None else TransferPath(force)
        cuda = device_pool.device.type == "cuda"
        self.kernel_ok = (cuda if use_kernel is None else use_kernel) and kernels.runs_on(device_pool.device)
        # Copy parts go out as batched calls (where a buffer has many runs) on CUDA with raw copies.
        self.batched = cuda and dma.dma_mode() is not dma.DmaMode.TORCH
        self.widest = host_pool.spec.widest_row_bytes
        for b in host_pool.spec.buffers:
            if not device_pool.raw_rows(b.name):
                why = "its device tensors are not packed rows of"
                log.info("buffer %r moves on the reference path: %s %s", b.name, why, b.dtype)
        if model is None and self.kernel_ok and cuda and self.force is None:
            model = calibrate.model_for(device_pool.device, [b.row_bytes for b in host_pool.spec.buffers])
        self.model = model
        self.groups = {d: self._groups(d) for d in Direction}

    def _groups(self, direction: Direction) -> tuple[Group, ...]:
        """Each buffer's `Choice`: the model's where it knows every row size, else `PathCosts`'."""
        spec, model = self.host_pool.spec, self.model
        found = (
            [model.planned(self.costs, b.row_bytes, direction, self.widest) for b in spec.buffers]
            if model
            else []
        )
        if not found or any(c is None for c in found):
            found = [Choice.fallback(self.costs, direction, b.row_bytes, self.widest) for b in spec.buffers]
        return tuple(
            Group(b.name, b.row_bytes, c, frozenset(b.layers))
            for b, c in zip(spec.buffers, found, strict=True)
        )

    def plan(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor | Sequence[int],
        device_slots: torch.Tensor | Sequence[int],
        stream: torch.cuda.Stream | None = None,
        layers_per_call: int = 1,
    ) -> TransferPlan:
        """Validate the pairs and plan the operation; raises before anything is written.

        `host_slots`, `device_slots`: `[n]` integer slot ids, CPU (`kvtier.slots.as_slots`); the
        destinations distinct. On CUDA the device indices are uploaded on `stream`.
        `layers_per_call`: the layers each `load_layers` / `backup` call of the plan will move
        (`page_first` stacks are sized for it; a call of other layers still moves every row).
        """
        direction = Direction(direction)
        load = direction is Direction.LOAD
        h = as_slot_tensor("host_slots", host_slots, self.host_pool.num_slots, distinct=not load)
        d = as_slot_tensor("device_slots", device_slots, self.device_pool.num_slots, distinct=load)
        if h.numel() != d.numel():
            raise SlotError(f"host_slots has {h.numel()} entries but device_slots has {d.numel()}")
        if isinstance(layers_per_call, bool) or not isinstance(layers_per_call, int) or layers_per_call < 1:
            raise PlanError(f"layers_per_call must be a positive int, got {layers_per_call!r}")
        return self._plan(direction, h, d, 1, stream, layers_per_call)

    def plan_allocated(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        runs: RunPair | None = None,
        stream: torch.cuda.Stream | None = None,
        whole_pages: bool = True,
        layers_per_call: int = 1,
    ) -> TransferPlan:
        """Plan an operation on slots from kvtier's allocators and tree, unchecked.

        `host_slots`, `device_slots`: `[n]` int64 CPU, in range, the destinations distinct;
        `whole_pages`: both whole allocator pages (runs found per page); `runs`: theirs, from
        which alone a copy-engine plan is built, without a pass over the slots;
        `layers_per_call`: as `plan`'s.
        """
        direction = Direction(direction)
        n = host_slots.numel()
        if n != device_slots.numel():
            raise SlotError(f"host_slots has {n} entries but device_slots has {device_slots.numel()}")
        copies = self.copies(n, runs, direction, layers_per_call) if runs is not None else None
        if copies is None:
            ps = self.host_pool.spec.page_size
            step = ps if whole_pages and n % ps == 0 else 1
            return self._plan(direction, host_slots, device_slots, step, stream, layers_per_call)
        return TransferPlan(
            direction=direction,
            path=copies.path,
            parts=(copies.part(),),
            host_slots=host_slots,
            device_slots=device_slots,
            host_runs=copies.host_runs,
            device_runs=copies.device_runs,
            joint_runs=copies.joint.shape[1],
            kernel=self.kernel,
            ready=None,
            host_pool=self.host_pool,
            device_pool=self.device_pool,
            layers_per_call=layers_per_call,
        )

    def copies(
        self, n: int, runs: RunPair, direction: Direction = Direction.LOAD, layers_per_call: int = 1
    ) -> RunCopies | None:
        """The copy-engine plan of `n` allocated slots given as `runs` (see `plan_allocated`),
        or None where the planner picks another mechanism for some row (or may: `page_first`
        calls of several layers, which may move as stacks)."""
        host_pool = self.host_pool
        if host_pool.layout is HostLayout.PAGE_FIRST and layers_per_call > 1:
            return None
        found = slot_runs.joint_runs(*runs, host_pool.segment_slots, host_pool.num_slots)
        lens = found.runs.length
        if int(lens.sum()) != n:
            raise PlanError(f"the runs cover {int(lens.sum())} slots, the plan has {n}")
        path = self.decide(n, found.host_runs, lens, Direction(direction))
        if path not in _COPY_PATHS:
            return None
        batched = self.batched and path is not TransferPath.PER_RUN
        streams = parts.copy_streams(host_pool.spec, n, len(lens), batched, self.costs)
        return RunCopies(
            path,
            found.runs.table,
            found.host_runs,
            found.device_runs,
            batched,
            streams,
            host_pool,
            self.device_pool,
        )

    def decide(self, n: int, host_runs: int, joint_lens: np.ndarray, direction: Direction) -> TransferPath:
        """The path of `n` rows in `host_runs` host runs and joint runs of `joint_lens` (`[k]` int64):
        `force`d, else as the module docstring says."""
        joint_runs, costs = len(joint_lens), self.costs
        if self.force is not None:
            return _forced(self.force, joint_runs, self.device_pool.device)
        if joint_runs <= 1:
            return TransferPath.SINGLE_COPY
        if host_runs == 1:
            return TransferPath.STAGED
        if self.kernel_ok:
            # MIXED here means "split by run" (`_parts`); the plan's path follows its parts.
            long = [joint_lens * g.row_bytes >= g.choice.copy_min_bytes for g in self.groups[direction]]
            every = all(bool(x.all()) for x in long)
            return TransferPath.BATCHED_DMA if every else TransferPath.MIXED
        nbytes, windows = n * self.widest, -(-n // self.device_pool.staging_tokens)
        estimates = {
            TransferPath.PER_RUN: costs.estimate(Mechanism.COPY, nbytes, joint_runs),
            TransferPath.STAGED: costs.estimate(Mechanism.STAGED, nbytes, host_runs + windows),
            TransferPath.REFERENCE: costs.estimate(Mechanism.REFERENCE, nbytes, 0),
        }
        return min(estimates, key=estimates.__getitem__)

    def _plan(
        self,
        direction: Direction,
        h: torch.Tensor,
        d: torch.Tensor,
        step: int,
        stream: torch.cuda.Stream | None,
        layers_per_call: int = 1,
    ) -> TransferPlan:
        """The plan of valid pairs `h`, `d` (`[n]` int64 CPU), runs found per `step` slots."""
        hn, dn = h.numpy(), d.numpy()
        found = slot_runs.scan(self.host_pool, hn, dn, step)
        _, joint_lens = found.joint
        path = self.decide(len(hn), len(found.host[0]), joint_lens, direction)
        up = Uploader(self.device_pool.device, stream)
        every = frozenset(b.name for b in self.host_pool.spec.buffers)
        stacked = self._stacks(hn, dn, layers_per_call, up)
        rest = every - stacked[0].buffers if stacked else every
        planned = tuple(stacked) + (self._parts(direction, path, found, hn, dn, d, up, rest) if rest else ())
        if path is TransferPath.MIXED or stacked:
            path = _path_of(planned)
        # Every buffer's choice comes from one source (`_groups`); a single copy needs none.
        source = "defaults" if path is TransferPath.SINGLE_COPY else self.groups[direction][0].choice.source
        return TransferPlan(
            direction=direction,
            path=path,
            parts=planned,
            host_slots=h,
            device_slots=d,
            host_runs=len(found.host[0]),
            device_runs=int(found.dev_break.sum()),
            joint_runs=len(joint_lens),
            kernel=self.kernel,
            ready=up.finish(),
            host_pool=self.host_pool,
            device_pool=self.device_pool,
            cost_model=source,
            layers_per_call=layers_per_call,
        )

    def _stacks(self, hn: np.ndarray, dn: np.ndarray, layers_per_call: int, up: Uploader) -> tuple[Part, ...]:
        """The plan's stack part (`stacks`), of the buffers worth it (every buffer where forced), or none."""
        if self.force not in (None, TransferPath.STACKED) or not (self.kernel_ok or self.force):
            return ()
        args = (self.host_pool, self.device_pool, self.costs, hn, dn, layers_per_call, up)
        part = stacks.planned(*args, forced=self.force is not None, raw_copies=self.batched)
        return () if part is None else (part,)

    def _parts(
        self,
        direction: Direction,
        path: TransferPath,
        found: slot_runs.Scan,
        hn: np.ndarray,
        dn: np.ndarray,
        d: torch.Tensor,
        up: Uploader,
        names: frozenset[str],
    ) -> tuple[Part, ...]:
        """The parts of a plan on `path` of the buffers `names`: `hn`, `dn` `[n]` int64 numpy (and `d`
        as a tensor)."""
        every = frozenset(b.name for b in self.host_pool.spec.buffers)
        build, only = functools.partial(self._build, direction, hn, dn, up), None if names == every else names
        if path in _COPY_PATHS:
            return build(copy=found.joint, batched=path is not TransferPath.PER_RUN, buffers=only)
        if path is TransferPath.STAGED:
            return build(staged=found.host, buffers=only)
        if path is TransferPath.KERNEL:
            return build(kernel=found.joint, buffers=only)
        if path is TransferPath.REFERENCE:
            return (parts.reference_part(d, up, names),)
        # Mixed, per buffer (`splits`): buffers that split alike share their parts.
        mine = [g for g in self.groups[direction] if g.name in names]
        out: list[Part] = []
        share = self.costs.copy_share(direction, self.kernel.overlap), self.costs.copy_share_min_bytes
        each = splits.split_all(mine, found, len(hn), self.costs.copy_min_bytes, *share)
        for group, split in splits.by_buffer(each):
            out += build(**split, buffers=None if group == every else group)
        return phases.placed(tuple(out), self.kernel, self.device_pool, direction)

    def _build(
        self,
        direction: Direction,
        hn: np.ndarray,
        dn: np.ndarray,
        up: Uploader,
        copy: Runs | None = None,
        staged: Runs | None = None,
        kernel_staged: Runs | None = None,
        kernel: Runs | None = None,
        batched: bool = True,
        buffers: Buffers = None,
    ) -> tuple[Part, ...]:
        """A part for each of `copy` (joint runs), `staged` and `kernel_staged` (host runs) and `kernel`
        (joint runs) given, of the named buffers."""
        host_pool, out = self.host_pool, []
        if copy is not None:
            s, n = copy
            batched = self.batched and batched
            streams = parts.copy_streams(host_pool.spec, int(n.sum()), len(n), batched, self.costs, buffers)
            table = RunTable.of(s, hn[s], dn[s], n)
            out.append(parts.copy_part(host_pool, table, batched, streams, buffers))
        by_kernel = units.KernelStaging(direction, self.device_pool, self.kernel)
        runs = ((staged, None), (kernel_staged, by_kernel))
        args = (host_pool, self.device_pool, direction, hn, dn, runs, self.batched, self.kernel.overlap)
        out += staging.staged_parts(*args, self.costs, up, buffers)
        if kernel is not None:
            args = (direction, host_pool, self.device_pool, hn, dn, *kernel, self.kernel, up, buffers)
            out.append(units.kernel_part(*args))
        return tuple(out)


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


def _path_of(planned: tuple[Part, ...]) -> TransferPath:
    """The path a split plan reports: its one mechanism's, or `MIXED`."""
    if len(planned) != 1:
        return TransferPath.MIXED
    (p,) = planned
    if isinstance(p, CopyPart):
        return TransferPath.BATCHED_DMA if p.batched else TransferPath.PER_RUN
    if isinstance(p, parts.StackPart):
        return TransferPath.STACKED
    return TransferPath.STAGED if isinstance(p, StagedPart) else TransferPath.KERNEL
