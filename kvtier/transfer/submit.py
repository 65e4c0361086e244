"""The one entry point through which KV moves between a host pool and a device pool.

`Transfers(host_pool, device_pool, ...)`, once per pool pair; `submit(op, lane, per_layer)` moves
one `Operation` and returns a `Transfer`: through the compiled loop (`native`) from the run lists
where the planner copies every row (a plan built only if read), else from the plan where the loop
makes every part (`loop.plan_work`), else through the plan executor, layer by layer.

Contract: the operation is ordered after the current compute stream's work and nothing waits for
the device; `per_layer`: a signal per model layer, else one at the end; the slots are trusted (the
cache's allocators and tree), `op.runs` describes them where given; if `submit` raises, the caller
drains the lane before reusing the slots. An operation of many copies is made from the loop's own
thread (`OFF_THREAD_S`): its signals wait for their records, and a call failing there is raised by
them (`CudaRuntimeError`), as a device fault would be.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.slots import concat_slots
from kvtier.transfer import native, probe
from kvtier.transfer.execute import layer_calls
from kvtier.transfer.lanes import Lane, Signal
from kvtier.transfer.loop import Work, copies_work, plan_work, run_buffers, run_work
from kvtier.transfer.options import KernelOptions, MeasuredCosts, PathCosts, TransferPath
from kvtier.transfer.plan import Planner, TransferPlan
from kvtier.transfer.runs import JointRuns, RunPair

log = logging.getLogger(__name__)

# `Transfers(loop=...)` left out: the process's compiled loop where the device pool is on CUDA.
DEFAULT_LOOP = object()
# The host's time to issue an operation's copies (`copy_host_s` each) above which the loop makes
# them from a thread of its own, the caller's thread returning at once (bench/FINDINGS.md).
OFF_THREAD_S = 100e-6


@dataclass(frozen=True)
class Operation:
    """One transfer, `host_slots[i]` <-> `device_slots[i]` in `direction`: `host_parts`, `[n_i]` int64
    CPU tensors in order (one per cache node; joined only for a plan); `device_slots`, `[n]` int64 CPU;
    `runs`, their `(host runs, device runs)` as `(first slot, length)` lists, where known;
    `whole_pages`: both sides whole allocator pages (runs found per page, not per slot)."""

    direction: Direction
    host_parts: tuple[torch.Tensor, ...]
    device_slots: torch.Tensor
    runs: RunPair | None = None
    whole_pages: bool = False

    @property
    def tokens(self) -> int:
        return int(self.device_slots.numel())

    @functools.cached_property
    def host_slots(self) -> torch.Tensor:
        """`[n]` int64 CPU: the host parts joined."""
        return concat_slots(self.host_parts)


@dataclass
class Transfer:
    """A submitted operation: its `signals` (per layer, or one) and its plan (built when first read).

    `done()` polls the last signal without waiting; `wait()` blocks until it fires.
    """

    signals: Sequence[Signal]
    _plan: TransferPlan | Callable[[], TransferPlan] | None = None

    @property
    def plan(self) -> TransferPlan | None:
        if callable(self._plan):
            self._plan = self._plan()
        return self._plan

    def done(self) -> bool:
        return not self.signals or self.signals[-1].query()

    def wait(self) -> None:
        if self.signals:
            self.signals[-1].wait_host()


class Transfers:
    """Moves operations between one host pool and one device pool (module docstring). `costs`,
    `kernel`, `force`: the planner's (without `costs`, on CUDA, those `probe.measured_costs` finds
    once per process); `loop`: the compiled loop (default: the process's on CUDA; None: never)."""

    def __init__(
        self,
        host_pool: HostPool,
        device_pool: DevicePool,
        *,
        costs: PathCosts | MeasuredCosts | None = None,
        kernel: KernelOptions | None = None,
        force: TransferPath | None = None,
        loop: native.Native | object | None = DEFAULT_LOOP,
    ) -> None:
        self.host_pool, self.device_pool = host_pool, device_pool
        if costs is None and force is None:
            costs = probe.measured_costs(device_pool.device)
        self.planner = Planner(host_pool, device_pool, costs, kernel, force)
        if loop is DEFAULT_LOOP:
            loop = native.library() if device_pool.device.type == "cuda" else None
        self._lib = loop
        # The pools never move: their addresses are bound to the loop once.
        self._buffers = run_buffers(host_pool, device_pool) if self._lib is not None else None
        if device_pool.device.type == "cuda" and self._buffers is None:
            log.info("transfers: no compiled loop here; every operation goes through the plan executor")

    def plan(
        self, op: Operation, stream: torch.cuda.Stream | None = None, found: JointRuns | None = None
    ) -> TransferPlan:
        """The plan of `op` (its device indices uploaded on `stream`; `found`: its joint runs, if known)."""
        return self.planner.plan_allocated(
            op.direction, op.host_slots, op.device_slots, found or op.runs, stream, whole_pages=op.whole_pages
        )

    def submit(self, op: Operation, lane: Lane, per_layer: bool) -> Transfer:
        """Move `op` on `lane`; see the module docstring for the signals and the contract."""
        layers = self.host_pool.spec.num_layers if per_layer else 1
        found = None if op.runs is None else self.planner.joint(op.runs, op.tokens)
        if self._buffers is not None and found is not None:
            copies = self.planner.copies(op.tokens, found, op.direction)
            work = None if copies is None else copies_work(copies, self._buffers)
            if work is not None and work.takes(self._lib):
                plan = functools.partial(self.plan, op, lane.stream, found)
                return Transfer(self._run(work, op.direction, lane, layers), plan)
        plan = self.plan(op, lane.stream, found)
        work = None if self._buffers is None else plan_work(plan, self._buffers, self._lib)
        if work is not None and work.takes(self._lib):
            return Transfer(self._run(work, op.direction, lane, layers), plan)
        lane.wait_for_current()
        calls = layer_calls(plan, lane.stream)
        if per_layer:
            return Transfer(lane.run_each(calls), plan)
        lane.submit(lambda: [call() for call in calls])
        return Transfer([lane.signal()], plan)

    def _run(self, work: Work, direction: Direction, lane: Lane, signals: int) -> Sequence[Signal]:
        """`work` submitted from the compiled loop on `lane`, with `signals` signals (from a thread of
        its own where its copies take the host more than `OFF_THREAD_S` to issue)."""
        submit = functools.partial(run_work, self._lib, work, self._buffers, direction)
        off = work.copies * self.planner.costs.of(direction).copy_host_s > OFF_THREAD_S
        return lane.run_native(submit, signals, work.streams, off_thread=off)
