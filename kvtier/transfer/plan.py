"""Transfer plans: decided once per operation, on CPU indices, before any layer moves.

A `Planner` holds one pool pair and one set of options, checked once. A plan pairs `host_slots[i]`
with `device_slots[i]`, finds their joint runs (`runs`) and gives every row of every buffer to one
part (`parts`) by `rule`; every layer reuses it. Every index the device needs is uploaded here, once,
before the plan's `ready` event; executing never reads a device tensor back, nor runs other pools.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import PlanError, SlotError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.slots import as_slot_tensor
from kvtier.spec import BufferSpec
from kvtier.transfer import cudart, kernels, options, parts, rule
from kvtier.transfer import runs as slot_runs
from kvtier.transfer.options import KernelOptions, MeasuredCosts, PathCosts, TransferPath
from kvtier.transfer.parts import KernelPart, Part
from kvtier.transfer.runs import RunPair, RunTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferPlan:
    """One operation's slot pairs (`[n]` int64 CPU each), their runs and the parts that move them;
    `ready`: a CUDA event after the plan's index uploads (None where nothing was uploaded), which
    executors wait on."""

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
        """SMs the plan takes from the model while it runs: its widest kernel grid (parts run in turn)."""
        return max((p.programs for p in self.parts if isinstance(p, KernelPart)), default=0)

    def mechanisms_by_buffer(self) -> dict[str, dict[str, int]]:
        """Per buffer name, the rows each mechanism moves."""
        out: dict[str, dict[str, int]] = {b.name: {} for b in self.host_pool.spec.buffers}
        for p in self.parts:
            for name in p.buffers:
                out[name][p.mechanism.value] = out[name].get(p.mechanism.value, 0) + p.rows
        return out

    def describe(self) -> str:
        mechs = "; ".join(
            f"{name}: " + ", ".join(f"{m} {r}" for m, r in by.items())
            for name, by in self.mechanisms_by_buffer().items()
        )
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
        costs: PathCosts | MeasuredCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | str | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """`Planner(...).plan(...)`: one operation's plan."""
        return Planner(host_pool, device_pool, costs, kernel, force).plan(
            direction, host_slots, device_slots, stream
        )


@dataclass(frozen=True)
class RunCopies:
    """An operation the copy engine moves whole, planned from run lists alone (`Planner.copies`):
    `joint`, a `RunTable`'s `[4, k]` int64 array; `streams`, as `CopyPart`'s."""

    joint: np.ndarray
    host_runs: int
    device_runs: int
    streams: int
    host_pool: HostPool = field(repr=False, compare=False)
    device_pool: DevicePool = field(repr=False, compare=False)


class Planner:
    """The planner's choices for one pool pair and one set of options, checked once: `costs`, one
    `PathCosts` for both directions or `MeasuredCosts` (default `PathCosts()`); `force`, one path
    instead of the rule (not `MIXED`); `use_kernel` (default: on CUDA with Triton)."""

    def __init__(
        self,
        host_pool: HostPool,
        device_pool: DevicePool,
        costs: PathCosts | MeasuredCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | str | None = None,
        use_kernel: bool | None = None,
    ) -> None:
        self.costs = options.per_direction(costs)
        self.kernel = kernel or KernelOptions()
        for c in (self.costs.load, self.costs.backup):
            options.check(host_pool, device_pool, c, self.kernel)
        self.host_pool, self.device_pool = host_pool, device_pool
        self.force = None if force is None else TransferPath(force)
        cuda = device_pool.device.type == "cuda"
        self.kernel_ok = (cuda if use_kernel is None else use_kernel) and kernels.runs_on(device_pool.device)
        if self.force is TransferPath.MIXED:
            raise PlanError("a mixed plan is the planner's choice; it cannot be forced")
        if self.force is TransferPath.KERNEL and not kernels.runs_on(device_pool.device):
            raise PlanError(
                f"the kernel path needs Triton and a CUDA device pool (or TRITON_INTERPRET=1), not "
                f"{device_pool.device}"
            )
        self.batched = cuda and cudart.dma_mode() is not cudart.DmaMode.TORCH
        self.raw = [b for b in host_pool.spec.buffers if device_pool.raw_rows(b.name)]
        for b in host_pool.spec.buffers:
            if b not in self.raw:
                log.info(
                    "buffer %r moves on the reference path: its device tensors are not packed rows", b.name
                )

    def plan(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor | Sequence[int],
        device_slots: torch.Tensor | Sequence[int],
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """Validate the pairs (`[n]` integer slot ids, CPU, the destinations distinct) and plan the
        operation, raising before anything is written; on CUDA the indices are uploaded on `stream`."""
        direction = Direction(direction)
        load = direction is Direction.LOAD
        h = as_slot_tensor("host_slots", host_slots, self.host_pool.num_slots, distinct=not load)
        d = as_slot_tensor("device_slots", device_slots, self.device_pool.num_slots, distinct=load)
        if h.numel() != d.numel():
            raise SlotError(f"host_slots has {h.numel()} entries but device_slots has {d.numel()}")
        found = slot_runs.scan(self.host_pool, h.numpy(), d.numpy(), 1)
        return self._plan(direction, h, d, found, stream)

    def plan_allocated(
        self,
        direction: Direction | str,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        runs: RunPair | slot_runs.JointRuns | None = None,
        stream: torch.cuda.Stream | None = None,
        whole_pages: bool = True,
    ) -> TransferPlan:
        """Plan an operation on slots from kvtier's allocators and tree, unchecked (`[n]` int64 CPU, in
        range, the destinations distinct): from `runs`, their run lists, without a pass over the
        slots; else with `whole_pages` (both whole allocator pages) runs are found per page."""
        direction = Direction(direction)
        n = host_slots.numel()
        if n != device_slots.numel():
            raise SlotError(f"host_slots has {n} entries but device_slots has {device_slots.numel()}")
        if runs is not None:
            found = self.joint(runs, n)
        else:
            ps = self.host_pool.spec.page_size
            step = ps if whole_pages and n % ps == 0 else 1
            found = slot_runs.scan(self.host_pool, host_slots.numpy(), device_slots.numpy(), step)
        return self._plan(direction, host_slots, device_slots, found, stream)

    def copies(
        self, n: int, runs: RunPair | slot_runs.JointRuns, direction: Direction = Direction.LOAD
    ) -> RunCopies | None:
        """The copy-engine plan of `n` allocated slots given as `runs` (see `plan_allocated`), or None
        where the planner gives some row to another mechanism."""
        found = self.joint(runs, n)
        if len(self.raw) != len(self.host_pool.spec.buffers) or not self.batched:
            return None
        lens = found.runs.length
        if any(j < len(lens) for j in self._copied(lens, Direction(direction)).values()):
            return None
        streams = self._streams(n, len(lens))
        pools = (self.host_pool, self.device_pool)
        return RunCopies(found.runs.table, found.host_runs, found.device_runs, streams, *pools)

    def joint(self, runs: RunPair | slot_runs.JointRuns, n: int) -> slot_runs.JointRuns:
        """The joint runs of run lists that must cover `n` slots (`PlanError` where they do not); joint
        runs found before are taken as they are."""
        if isinstance(runs, slot_runs.JointRuns):
            return runs
        found = slot_runs.joint_runs(*runs, self.host_pool.segment_slots, self.host_pool.num_slots)
        if int(found.runs.length.sum()) != n:
            raise PlanError(f"the runs cover {int(found.runs.length.sum())} slots, the plan has {n}")
        return found

    def _copied(self, lens: np.ndarray, direction: Direction) -> dict[str, int]:
        """Per raw buffer, how many of the joint runs (`lens`, `[k]` int64, longest first or not) the
        copy engine takes: the rule's choice, or all or none where forced or without the kernel."""
        k = len(lens)
        # A forced path holds for any runs, one joint run included.
        if self.force is TransferPath.KERNEL:
            return {b.name: 0 for b in self.raw}
        if self.force is TransferPath.REFERENCE:
            return {b.name: -1 for b in self.raw}  # -1: the reference path
        if self.force is TransferPath.COPY or k <= 1:
            return {b.name: k for b in self.raw}
        costs = self.costs.of(direction)
        if not self.kernel_ok:
            nbytes = int(lens.sum()) * self.host_pool.spec.widest_row_bytes
            pays = rule.without_kernel(costs, k, nbytes)
            return {b.name: k if pays else -1 for b in self.raw}
        return rule.choose(costs, lens, {b.name: b.row_bytes for b in self.raw}, self.kernel.max_unit_bytes)

    def _streams(self, rows: int, runs: int) -> int:
        """Streams a layer's copies fan out over (`PathCosts.copy_streams` for short runs, else one)."""
        widest = self.host_pool.spec.widest_row_bytes
        costs = self.costs.load  # the fan-out is not measured: one value for both directions
        short = self.batched and runs and rows * widest < costs.fan_out_below_bytes * runs
        return costs.copy_streams if short else 1

    def _plan(
        self,
        direction: Direction,
        h: torch.Tensor,
        d: torch.Tensor,
        found: slot_runs.JointRuns,
        stream: torch.cuda.Stream | None,
    ) -> TransferPlan:
        """The plan of valid pairs `h`, `d` (`[n]` int64 CPU) whose joint runs are `found`."""
        table = found.runs
        lens = table.length
        up = Uploader(self.device_pool.device, stream)
        planned: list[Part] = []
        # Buffers the rule treats alike share their parts.
        by_choice: dict[int, list[BufferSpec]] = {}
        for name, j in self._copied(lens, direction).items():
            by_choice.setdefault(j, []).append(self.host_pool.spec.buffer(name))
        order = rule.longest_first(lens)
        for j, buffers in by_choice.items():
            if j < 0:
                planned.append(parts.reference_part(torch.arange(h.numel()), d, _names(buffers), up))
                continue
            copy, kern = np.sort(order[:j]), np.sort(order[j:])
            if len(copy):
                runs = RunTable(table.table[:, copy])
                streams = self._streams(int(lens[copy].sum()), len(copy))
                planned.append(parts.copy_part(self.host_pool, runs, buffers, self.batched, streams))
            if len(kern):
                where = (table.host[kern], table.device[kern], lens[kern], buffers, self.kernel, up)
                planned.append(parts.kernel_part(direction, self.host_pool, self.device_pool, *where))
        others = _names([b for b in self.host_pool.spec.buffers if b not in self.raw])
        if others:
            planned.append(parts.reference_part(torch.arange(h.numel()), d, others, up))
        return TransferPlan(
            direction=direction,
            path=_path_of(planned, self.force),
            parts=tuple(planned),
            host_slots=h,
            device_slots=d,
            host_runs=found.host_runs,
            device_runs=found.device_runs,
            joint_runs=len(lens),
            kernel=self.kernel,
            ready=up.finish(),
            host_pool=self.host_pool,
            device_pool=self.device_pool,
        )


def _names(buffers: list[BufferSpec]) -> frozenset[str]:
    return frozenset(b.name for b in buffers)


def _path_of(planned: list[Part], force: TransferPath | None) -> TransferPath:
    """The path a plan reports: its one mechanism's, or `MIXED`; a plan of no part (no rows), the
    forced path or `COPY`."""
    found = {p.mechanism for p in planned}
    if not found:
        return force or TransferPath.COPY
    return found.pop() if len(found) == 1 else TransferPath.MIXED


class Uploader:
    """Copies CPU index tensors to the plan's device on one stream, then records `ready`."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device, self.stream, self.used = device, stream, False
        if device.type == "cuda" and stream is None:
            self.stream = torch.cuda.current_stream(device)

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
