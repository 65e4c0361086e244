"""Transfer plans: decided once per operation, on CPU indices, before any layer moves.

A plan pairs host slots with device slots (`host_slots[i]` <-> `device_slots[i]`),
validates them, splits the pair lists into runs and picks one path for the whole
operation. Every buffer of the spec and every layer reuses the same plan, so the
MLA latent and the DSA indexer of a token always move together. Building a plan
is the only place where indices are inspected: executing it never reads a device
tensor back to the host.

Runs:
- a host run is a maximal stretch of the list where the host slot goes up by one
  and stays inside one host segment (rows contiguous in host memory);
- a joint run also needs the device slot to go up by one.

Paths:
- `SINGLE_COPY`: one joint run; one copy per buffer and layer.
- `STAGED`: host runs are copied into a device staging buffer back to back, then
  one on-device `index_copy_` (load) or `index_select` (backup) places the rows;
  the path for a host slab (or a few long host runs) with scattered device slots.
- `PER_RUN`: one copy per joint run; for a few long runs on both sides.
- `REFERENCE`: per-token gather and scatter through host memory; always correct,
  slow, and on CUDA it synchronises the host.

The planner estimates the time of each applicable path from `PathCosts` (a fixed
cost per copy issued, and the bandwidth of each mechanism, measured on the GPU by
`kvtier bench transfer`) and takes the cheapest. One joint run is always a single
copy; a host slab with scattered device slots is always staged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from kvtier.errors import PlanError, SlotError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool


@dataclass(frozen=True)
class PathCosts:
    """What the planner assumes a mechanism costs (defaults measured on an H200, PCIe Gen5).

    `copy_issue_s`: host time to issue one copy from Python, which also bounds how
    fast small copies go; `copy_gbps`: the copy engine between pinned host memory and
    the device; `device_gbps`: an on-device `index_copy_` of rows; `reference_gbps`:
    the per-token path through host memory.
    """

    copy_issue_s: float = 11e-6
    copy_gbps: float = 54.0
    device_gbps: float = 1200.0
    reference_gbps: float = 3.0

    def estimate(self, path: TransferPath, nbytes: int, copies: int) -> float:
        """Seconds to move `nbytes` of one layer on `path` with `copies` copy-engine copies."""
        if path is TransferPath.REFERENCE:
            return self.copy_issue_s + nbytes / (self.reference_gbps * 1e9)
        t = copies * self.copy_issue_s + nbytes / (self.copy_gbps * 1e9)
        if path is TransferPath.STAGED:
            t += self.copy_issue_s + nbytes / (self.device_gbps * 1e9)
        return t


class TransferPath(str, Enum):
    """How a plan moves its rows."""

    SINGLE_COPY = "single_copy"
    STAGED = "staged"
    PER_RUN = "per_run"
    REFERENCE = "reference"


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
class TransferPlan:
    """One operation's slot pairs, their runs and the chosen path.

    `host_slots`, `device_slots`: `[n]` int64 on CPU. `device_index`: `device_slots` on
    the device pool's device (only for paths that index on the device), uploaded
    once and ordered by `ready` (a CUDA event) before first use.
    """

    direction: Direction
    path: TransferPath
    host_slots: torch.Tensor
    device_slots: torch.Tensor
    pieces: tuple[Piece, ...]
    host_runs: int
    device_runs: int
    joint_runs: int
    device_index: torch.Tensor | None
    ready: torch.cuda.Event | None

    @property
    def num_tokens(self) -> int:
        return int(self.host_slots.numel())

    def describe(self) -> str:
        return (
            f"{self.direction.value} {self.num_tokens} tokens via {self.path.value}: "
            f"{self.host_runs} host runs, {self.device_runs} device runs, {self.joint_runs} joint runs, "
            f"{len(self.pieces)} pieces"
        )

    @classmethod
    def build(
        cls,
        direction: Direction | str,
        host_pool: HostPool,
        device_pool: DevicePool,
        host_slots: torch.Tensor | list[int],
        device_slots: torch.Tensor | list[int],
        *,
        costs: PathCosts | None = None,
        force: TransferPath | str | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> TransferPlan:
        """Validate the pairs and plan the operation; raises before anything is written.

        `host_slots`, `device_slots`: `[n]` integer slot ids, CPU. For a load the
        device slots must be distinct, for a backup the host slots. `costs` tunes the
        planner; `force` picks a path instead (benchmarks and tests); `SINGLE_COPY` can
        only be forced on one joint run. On CUDA the device index is uploaded on `stream`.
        """
        direction = Direction(direction)
        if _shape_of(host_pool.spec) != _shape_of(device_pool.spec):
            raise PlanError(
                f"host pool spec {host_pool.spec.name!r} and device pool spec {device_pool.spec.name!r} "
                "have different buffers, layers or row shapes"
            )
        h = _as_slots("host_slots", host_slots, host_pool.num_slots)
        d = _as_slots("device_slots", device_slots, device_pool.num_slots)
        if h.numel() != d.numel():
            raise SlotError(f"host_slots has {h.numel()} entries but device_slots has {d.numel()}")
        dst_name, dst = ("device_slots", d) if direction is Direction.LOAD else ("host_slots", h)
        _check_distinct(dst_name, dst)

        hn, dn = h.numpy(), d.numpy()
        seg = host_pool.segment_slots
        host_break = np.ones(len(hn), dtype=bool)
        dev_break = np.ones(len(dn), dtype=bool)
        if len(hn):
            host_break[1:] = (hn[1:] != hn[:-1] + 1) | (hn[1:] % seg == 0)
            dev_break[1:] = dn[1:] != dn[:-1] + 1
        joint_break = host_break | dev_break
        host_starts, host_lens = _runs(host_break)
        joint_starts, joint_lens = _runs(joint_break)

        if force is not None:
            path = TransferPath(force)
            if path is TransferPath.SINGLE_COPY and len(joint_starts) > 1:
                raise PlanError(f"cannot force a single copy over {len(joint_starts)} joint runs")
        else:
            path = _cheapest(
                costs or PathCosts(),
                nbytes=len(hn) * max(b.row_bytes for b in host_pool.spec.buffers),
                host_runs=len(host_starts),
                joint_runs=len(joint_starts),
                windows=-(-len(hn) // device_pool.staging_tokens),
            )

        if path is TransferPath.STAGED:
            pieces = _pieces(hn, dn, host_starts, host_lens)
        elif path is TransferPath.REFERENCE:
            pieces = ()
        else:
            pieces = _pieces(hn, dn, joint_starts, joint_lens)
        device_index, ready = None, None
        if path in (TransferPath.STAGED, TransferPath.REFERENCE):
            device_index, ready = _upload(d, device_pool.device, stream)
        return cls(
            direction=direction,
            path=path,
            host_slots=h,
            device_slots=d,
            pieces=pieces,
            host_runs=len(host_starts),
            device_runs=int(dev_break.sum()),
            joint_runs=len(joint_starts),
            device_index=device_index,
            ready=ready,
        )


def _as_slots(name: str, slots: torch.Tensor | list[int], limit: int) -> torch.Tensor:
    """`slots` as a `[n]` int64 CPU tensor, every id in `[0, limit)`."""
    if isinstance(slots, torch.Tensor):
        if slots.device.type != "cpu":
            raise SlotError(f"{name} must be on the CPU (plans are built on CPU indices), got {slots.device}")
        if slots.dim() != 1 or slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool:
            raise SlotError(
                f"{name} must be a 1-D integer tensor, got {slots.dtype} of shape {tuple(slots.shape)}"
            )
        t = slots.to(torch.int64).contiguous()
    else:
        try:
            t = torch.as_tensor(list(slots), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SlotError(f"{name} must be a sequence of ints: {e}") from None
    bad = t[(t < 0) | (t >= limit)]
    if bad.numel():
        raise SlotError(f"{name} has ids outside [0, {limit}): {bad[:10].tolist()} ({bad.numel()} in all)")
    return t


def _check_distinct(name: str, slots: torch.Tensor) -> None:
    if slots.numel() < 2:
        return
    s, _ = torch.sort(slots)
    dup = s[1:][s[1:] == s[:-1]]
    if dup.numel():
        raise SlotError(f"{name} (the destination) repeats ids {torch.unique(dup)[:10].tolist()}")


def _cheapest(costs: PathCosts, nbytes: int, host_runs: int, joint_runs: int, windows: int) -> TransferPath:
    """The path with the lowest estimated time for one layer of the widest buffer."""
    if joint_runs <= 1:
        return TransferPath.SINGLE_COPY
    if host_runs == 1:
        return TransferPath.STAGED
    estimates = {
        TransferPath.PER_RUN: costs.estimate(TransferPath.PER_RUN, nbytes, joint_runs),
        TransferPath.STAGED: costs.estimate(TransferPath.STAGED, nbytes, host_runs + windows),
        TransferPath.REFERENCE: costs.estimate(TransferPath.REFERENCE, nbytes, 0),
    }
    return min(estimates, key=estimates.__getitem__)


def _shape_of(spec) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    return [(b.name, b.layers, b.row_shape) for b in spec.buffers]


def _runs(breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs that `breaks` (`[n]` bool) delimits."""
    starts = np.flatnonzero(breaks)
    return starts, np.diff(np.append(starts, len(breaks)))


def _pieces(hn: np.ndarray, dn: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> tuple[Piece, ...]:
    return tuple(
        Piece(p, h, d, n)
        for p, h, d, n in zip(
            starts.tolist(), hn[starts].tolist(), dn[starts].tolist(), lens.tolist(), strict=True
        )
    )


def _upload(
    slots: torch.Tensor, device: torch.device, stream: torch.cuda.Stream | None
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    if device.type != "cuda":
        return slots, None
    stream = stream or torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        index = slots.pin_memory().to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    return index, ready
