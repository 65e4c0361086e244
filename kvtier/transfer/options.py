"""What the planner assumes and how the kernel is shaped: `PathCosts`, `KernelOptions`, `KernelLaunch`.

Values only: a `Planner` checks them once (`check`) and every plan it makes reuses them.
The defaults are the tuned values of `bench/FINDINGS.md`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

import torch

from kvtier.pool.device import Direction
from kvtier.transfer import kernels


class Mechanism(str, Enum):
    """How one part of a plan moves its rows."""

    COPY = "copy"
    STAGED = "staged"
    KERNEL = "kernel"
    REFERENCE = "reference"


@dataclass(frozen=True)
class PathCosts:
    """What the planner assumes each mechanism costs (defaults: bench/FINDINGS.md).

    `copy_issue_s`: host time to issue one copy from Python; `copy_gbps`: the copy
    engine between pinned host memory and the device; `device_gbps`: an on-device
    `index_copy_` of rows; `reference_gbps`: the per-token path through host memory.
    `copy_min_bytes`: a joint run at least this long goes to the copy engine when the
    kernel takes the rest. `staged_min_bytes`: a host run at least this long whose
    device slots are scattered is loaded through staging then (backups keep the
    kernel, whose scatter beats staging then copying out). `copy_streams`: batched
    copies of one layer are spread over this many streams, so several copy engines
    overlap their per-copy cost. `fan_out_below_bytes`: joint runs averaging at least
    this long stay on one stream: a copy's fixed cost is then small beside it, while
    fanning out costs two event calls per side stream and layer.
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
class KernelLaunch:
    """One launch's shape: `programs` (SMs), `rows` per tile, `stages` tiles in flight per program."""

    programs: int
    rows: int
    stages: int


@dataclass(frozen=True)
class KernelOptions:
    """The gather/scatter kernel's budget and shape.

    Up to `sm_budget` programs with `rows_per_program` rows per tile each (None: by row
    size, see `kernels.rows_in_flight`) and up to `stages` tiles in flight each (None: as
    many as the device's shared memory holds, up to `kernels.MAX_STAGES`; 1: no
    pipelining; only loads of rows that are whole 128-byte lines are pipelined). Runs are
    moved in units of up to `max_unit_bytes`. With `lean` (and rows chosen by size), rows
    of `kernels.LEAN_ROW_BYTES` or more take only the programs that keep the grid's bytes
    in flight (`kernels.programs_for`): they fill the link as the whole budget does, and
    the model beside keeps the other SMs. `launch` gives one launch's shape.
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


@functools.lru_cache(maxsize=256)
def _launch(
    opts: KernelOptions, row_bytes: int, align_bytes: int, device: torch.device | None, gather: bool
) -> KernelLaunch:
    """`KernelOptions.launch`, kept per argument set: a plan asks it once per buffer and host region."""
    stages = kernels.stages_for(row_bytes, align_bytes, device, opts.stages, gather)
    if opts.rows_per_program is not None or not opts.lean:
        programs = opts.sm_budget
    else:
        programs = kernels.programs_for(row_bytes, opts.sm_budget, stages)
    rows = opts.rows_per_program or kernels.rows_in_flight(row_bytes, programs, stages)
    return KernelLaunch(programs, rows, stages)
