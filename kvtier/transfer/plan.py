"""Transfer plans: decided once per operation, on CPU indices, before any layer moves.

A `Planner` holds one pool pair and one set of options, checked once. A plan pairs
host slots with device slots (`host_slots[i]` <-> `device_slots[i]`), finds their
runs (`kvtier.transfer.runs`) and gives every row to one part (`kvtier.transfer.parts`),
each moved by one mechanism. Every buffer of the spec and every layer reuses the same
plan, so the MLA latent and the DSA indexer of a token always move together. Building
a plan is the only place where indices are inspected: executing it never reads a
device tensor back to the host, and every index it needs on the device is uploaded
once, here, ordered by the plan's `ready` event. A plan records the pools it was built
for; the executors refuse others.

The choice: one joint run is a single copy; a single host run with scattered device
slots is staged; otherwise, where the kernel can run (CUDA and Triton), long joint
runs go to batched DMA, long host runs whose device slots are scattered to staging
(loads only), and the remaining rows to the kernel; without the kernel it takes the
cheapest of per-run copies, staging and the reference path by `PathCosts`.
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
from kvtier.transfer import dma, kernels, options, parts
from kvtier.transfer import runs as slot_runs
from kvtier.transfer.options import KernelOptions, Mechanism, PathCosts, TransferPath
from kvtier.transfer.parts import CopyPart, KernelPart, Part, RunCopies, StagedPart, Uploader
from kvtier.transfer.runs import RunPair, RunTable

log = logging.getLogger(__name__)


_COPY_PATHS = (TransferPath.SINGLE_COPY, TransferPath.PER_RUN, TransferPath.BATCHED_DMA)


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
        return max((p.programs for p in self.parts if isinstance(p, KernelPart)), default=0)

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
        whole_pages: bool = True,
    ) -> TransferPlan:
        """Plan an operation on slots from kvtier's allocators and tree, unchecked.

        `host_slots`, `device_slots`: `[n]` int64 CPU tensors, in range, the destinations
        distinct. `whole_pages`: both sides are whole allocator pages (each page's slots
        consecutive from a page-aligned id), so runs are found per page, not per slot (a
        node's device slots, which a caller may have ordered freely, are not). `runs`: their
        `(host runs, device runs)`, each a list of `(first slot, length)` in plan order (as
        the allocators hand them out): a copy-engine plan is then built from the runs alone,
        without a pass over the slots. On CUDA the device indices are uploaded on `stream`.
        """
        direction = Direction(direction)
        n = host_slots.numel()
        if n != device_slots.numel():
            raise SlotError(f"host_slots has {n} entries but device_slots has {device_slots.numel()}")
        copies = self.copies(n, runs) if runs is not None else None
        if copies is None:
            ps = self.host_pool.spec.page_size
            step = ps if whole_pages and n % ps == 0 else 1
            return self._plan(direction, host_slots, device_slots, step, stream)
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

    def copies(self, n: int, runs: RunPair) -> RunCopies | None:
        """The copy-engine plan of `n` allocated slots given as `runs` (see `plan_allocated`),
        or None where the planner picks another mechanism for some row."""
        host_pool = self.host_pool
        found = slot_runs.joint_runs(*runs, host_pool.segment_slots, host_pool.num_slots)
        lens = found.runs.length
        if int(lens.sum()) != n:
            raise PlanError(f"the runs cover {int(lens.sum())} slots, the plan has {n}")
        long_runs = int((lens * self.widest >= self.costs.copy_min_bytes).sum())
        path = self.decide(n, found.host_runs, len(lens), long_runs)
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

    def _plan(
        self,
        direction: Direction,
        h: torch.Tensor,
        d: torch.Tensor,
        step: int,
        stream: torch.cuda.Stream | None,
    ) -> TransferPlan:
        """The plan of valid pairs `h`, `d` (`[n]` int64 CPU), runs found per `step` slots."""
        hn, dn = h.numpy(), d.numpy()
        found = slot_runs.scan(self.host_pool, hn, dn, step)
        _, joint_lens = found.joint
        long_runs = int((joint_lens * self.widest >= self.costs.copy_min_bytes).sum())
        path = self.decide(len(hn), len(found.host[0]), len(joint_lens), long_runs)
        up = Uploader(self.device_pool.device, stream)
        planned = self._parts(direction, path, found, hn, dn, d, up)
        if path is TransferPath.MIXED:
            path = _path_of(planned)
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
        )

    def _parts(
        self,
        direction: Direction,
        path: TransferPath,
        found: slot_runs.Scan,
        hn: np.ndarray,
        dn: np.ndarray,
        d: torch.Tensor,
        up: Uploader,
    ) -> tuple[Part, ...]:
        """The parts of a plan on `path`: `hn`, `dn` `[n]` int64 numpy (and `d` as a tensor)."""
        host_pool, device_pool, costs = self.host_pool, self.device_pool, self.costs
        js, jl = found.joint
        cap = device_pool.staging_tokens
        if path in _COPY_PATHS:
            batched = self.batched and path is not TransferPath.PER_RUN
            streams = parts.copy_streams(host_pool.spec, len(hn), len(jl), batched, costs)
            return (parts.copy_part(host_pool, RunTable.of(js, hn[js], dn[js], jl), batched, streams),)
        if path is TransferPath.STAGED:
            hs, hl = found.host
            return (parts.staged_part(host_pool, hn, dn, hs, hl, cap, self.batched, costs.copy_streams, up),)
        if path is TransferPath.KERNEL:
            return (parts.kernel_part(direction, host_pool, device_pool, hn, dn, js, jl, self.kernel, up),)
        if path is TransferPath.MIXED:
            # Backups keep the kernel for these rows: its scatter beats staging then copying out.
            staged_min = costs.staged_min_bytes if direction is Direction.LOAD else None
            split = _RunSplit.of(
                js, jl, found.host_break, found.step, self.widest, costs.copy_min_bytes, staged_min
            )
            return split.parts(self, direction, hn, dn, up)
        return (parts.reference_part(d, up),)


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
        # MIXED here means "split by run" (`_RunSplit`); the plan's path follows its parts.
        return TransferPath.BATCHED_DMA if long_runs == joint_runs else TransferPath.MIXED
    estimates = {
        TransferPath.PER_RUN: costs.estimate(Mechanism.COPY, nbytes, joint_runs),
        TransferPath.STAGED: costs.estimate(Mechanism.STAGED, nbytes, host_runs + windows),
        TransferPath.REFERENCE: costs.estimate(Mechanism.REFERENCE, nbytes, 0),
    }
    return min(estimates, key=estimates.__getitem__)


@dataclass(frozen=True)
class _RunSplit:
    """Joint runs sorted by mechanism: `[runs]` int64 positions and lengths per class.

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
    ) -> _RunSplit:
        """Classify joint runs (`starts`, `lens` in positions); `host_break` per `step` slots.

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
        self, planner: Planner, direction: Direction, hn: np.ndarray, dn: np.ndarray, up: Uploader
    ) -> tuple[Part, ...]:
        host_pool, costs, batched = planner.host_pool, planner.costs, planner.batched
        out: list[Part] = []
        if len(self.copy[0]):
            s, n = self.copy
            streams = parts.copy_streams(host_pool.spec, int(n.sum()), len(n), batched, costs)
            out.append(parts.copy_part(host_pool, RunTable.of(s, hn[s], dn[s], n), batched, streams))
        if len(self.staged[0]):
            cap = planner.device_pool.staging_tokens
            out.append(
                parts.staged_part(host_pool, hn, dn, *self.staged, cap, batched, costs.copy_streams, up)
            )
        if len(self.kernel[0]):
            out.append(
                parts.kernel_part(
                    direction, host_pool, planner.device_pool, hn, dn, *self.kernel, planner.kernel, up
                )
            )
        return tuple(out)


def _path_of(planned: tuple[Part, ...]) -> TransferPath:
    """The path a split plan reports: its one mechanism's, or `MIXED`."""
    if len(planned) != 1:
        return TransferPath.MIXED
    (p,) = planned
    if isinstance(p, CopyPart):
        return TransferPath.BATCHED_DMA if p.batched else TransferPath.PER_RUN
    return TransferPath.STAGED if isinstance(p, StagedPart) else TransferPath.KERNEL
