"""What the planner is told: the paths it may be forced to (`TransferPath`), what it assumes each
mechanism costs (`PathCosts`) and how the kernel is shaped (`KernelOptions`); a `Planner` checks
them once (`check`). The defaults are the tuned values of `bench/FINDINGS.md`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

import torch

from kvtier.errors import ConfigError, PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.transfer import launch as rules
from kvtier.transfer.launch import LINE_BYTES, KernelLaunch


class TransferPath(str, Enum):
    """What a plan does as a whole (for logs, benchmarks and `Planner`'s `force`).

    - `SINGLE_COPY`, `PER_RUN`, `BATCHED_DMA`: the copy engine, one copy per joint run (one
      copy, torch copies, or one batched call per buffer and layer); no SMs, long runs only.
    - `STAGED`: long host runs through a device staging buffer onto scattered device slots.
    - `STACKED`: `page_first` runs of pages, several layers of each page in one copy-engine
      copy into the staging buffer (or out of it), each layer placed on the device there
      (`kvtier.transfer.stacks`).
    - `KERNEL`: a Triton kernel on pinned host memory, `sm_budget` programs; any runs.
    - `MIXED`: more than one of these, split by run (the planner's choice only).
    - `REFERENCE`: per-token gather and scatter through host memory; synchronises the host.
    """

    SINGLE_COPY = "single_copy"
    PER_RUN = "per_run"
    BATCHED_DMA = "batched_dma"
    STAGED = "staged"
    STACKED = "stacked"
    KERNEL = "kernel"
    MIXED = "mixed"
    REFERENCE = "reference"


class Mechanism(str, Enum):
    """How one part of a plan moves its rows."""

    COPY = "copy"
    STAGED = "staged"
    STACKED = "stacked"
    KERNEL = "kernel"
    REFERENCE = "reference"


@dataclass(frozen=True)
class PathCosts:
    """What the planner assumes each mechanism costs (defaults: bench/FINDINGS.md).

    `copy_issue_s`: host time to issue one copy from Python; `copy_gbps`: the copy engine
    between pinned host memory and the device; `device_gbps`: an on-device `index_copy_`;
    `reference_gbps`: the per-token path. With the kernel, a buffer's joint run of
    `copy_min_bytes` goes to the copy engine, and a host run with scattered device slots of
    `staged_min_bytes` (loads) or `backup_staged_min_bytes` (backups) goes through staging
    (`kvtier.transfer.costs.Choice.fallback`). A measured cost model stages a backup's host run by
    the copy engine only from `backup_staged_floor_bytes` of the widest rows (`staged_floor`).
    `backup_copy_share`: where a backup overlaps, that share of a buffer's pieces for the kernel of
    `copy_share_min_bytes` or more go to the copy engine beside it, where its split gives the copy
    engine nothing (`copy_share`, `kvtier.transfer.splits.shared`).
    `copy_streams`: streams one layer's batched copies are
    spread over, unless its joint runs average `fan_out_below_bytes` or more (a copy's
    fixed cost is then small beside fanning out's event calls). In `page_first`, a call of
    several layers moves a buffer's runs of pages as stacks (`STACKED`) where its runs average
    `stack_min_bytes` on the host, and (a call of some of the buffer's layers: 2-D copies)
    their lines are `stack_line_min_bytes` or longer.
    """

    copy_issue_s: float = 11e-6
    copy_gbps: float = 54.0
    device_gbps: float = 1200.0
    reference_gbps: float = 3.0
    copy_min_bytes: int = 64 << 10
    staged_min_bytes: int = 64 << 10
    backup_staged_min_bytes: int = 1 << 20
    backup_staged_floor_bytes: int = 384 << 10
    backup_copy_share: float = 0.3
    copy_share_min_bytes: int = 16 << 10
    copy_streams: int = 8
    fan_out_below_bytes: int = 1 << 20
    stack_min_bytes: int = 512 << 10
    stack_line_min_bytes: int = 24 << 10

    def staged_floor(self, direction: Direction, row_bytes: int, widest: int) -> float:
        """The fewest bytes of a host run of `row_bytes` rows (in a spec whose widest row is `widest`)
        that a measured cost model may stage by the copy engine, where it does not stage shorter
        runs by the kernel's units (`Choice.of`): for a backup,
        `backup_staged_floor_bytes` of the widest rows, scaled to these (a token's buffers go
        together); for a load, no floor but `copy_min_bytes` (`Choice.of`'s own).

        Why: a backup's staging, timed whole, crosses the kernel's rate at ~210-450 KiB by lease, and
        a calibration putting it under the 295 KB host runs of 1152-byte rows staged them at
        0.900-0.916 of the ceiling where the kernel moves them at 0.929-0.95 (bench/FINDINGS.md, "The
        measured cost model")."""
        if direction is Direction.LOAD:
            return 0.0
        return self.backup_staged_floor_bytes * row_bytes / widest

    def copy_share(self, direction: Direction, overlap: bool) -> float:
        """The share of a buffer's kernel pieces that go to the copy engine beside the kernel: for an
        overlapped backup, `backup_copy_share`; else none.

        Why: the kernel writes host memory at ~0.94 of the ceiling, the copy engine's thousands of 18 KB
        pieces alone at 0.60-0.78; side by side, a third of the pieces on the copy engine moved runs of
        16 rows at 0.955-0.963 against 0.934-0.941 (`glm-5`, `deepseek-v3`, both device sets), half at
        0.77-0.94. A load's reads lost at every share (0.56-0.905 at 0.15, 0.25-0.56 at 0.3;
        bench/FINDINGS.md, "Overlapped parts")."""
        return self.backup_copy_share if direction is Direction.BACKUP and overlap else 0.0

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
    """The gather/scatter kernel's budget and shape (the rules: `kvtier.transfer.launch`).

    Up to `sm_budget` programs with `rows_per_program` rows per tile each (None: by row
    size) and up to `stages` tiles in flight each (None: as many as shared memory holds,
    where rows are pipelined; 1: none). Runs move in units of up to `max_unit_bytes`. With
    `lean` (and rows by size), long rows take only the programs that keep the grid's bytes
    in flight (`launch.programs_for`), twice that for scattered rows over a wide host span. With
    `overlap`, a layer's direct kernel parts run on a second stream beside its copy-engine parts
    (`kvtier.transfer.execute`). `launch` gives one launch's shape.
    """

    sm_budget: int = 8
    rows_per_program: int | None = None
    max_unit_bytes: int = 16 << 10
    lean: bool = True
    stages: int | None = None
    overlap: bool = True

    def launch(
        self,
        row_bytes: int,
        align_bytes: int = LINE_BYTES,
        device: torch.device | None = None,
        direction: Direction = Direction.LOAD,
        wide: bool = False,
    ) -> KernelLaunch:
        """The launch for rows of `row_bytes` at offsets that are multiples of `align_bytes`, moved in
        `direction` on `device` (None or the CPU: as for a GPU whose shared memory holds every stage),
        the host rows over a `wide` span (`launch.is_wide`) or not."""
        shared = rules.shared_bytes(device)
        return _launch(self, row_bytes, align_bytes, shared, direction is Direction.LOAD, wide)


@functools.lru_cache(maxsize=256)
def _launch(
    opts: KernelOptions, row_bytes: int, align_bytes: int, shared: int | None, gather: bool, wide: bool
) -> KernelLaunch:
    """`KernelOptions.launch` on a device with `shared` bytes per program, kept per argument set."""
    stages = rules.stages_for(row_bytes, align_bytes, shared, opts.stages, gather)
    if opts.rows_per_program is not None or not opts.lean:
        programs = opts.sm_budget
    else:
        programs = rules.programs_for(row_bytes, opts.sm_budget, stages, wide)
    rows = opts.rows_per_program or rules.rows_in_flight(row_bytes, programs, stages)
    return KernelLaunch(programs, rows, stages)


def check(host_pool: HostPool, device_pool: DevicePool, costs: PathCosts, kernel: KernelOptions) -> None:
    """Refuse pools of different shapes (`PlanError`) and options out of range (`ConfigError`)."""
    hspec, dspec = host_pool.spec, device_pool.spec
    shapes = [[(b.name, b.layers, b.row_shape) for b in spec.buffers] for spec in (hspec, dspec)]
    if hspec is not dspec and shapes[0] != shapes[1]:
        raise PlanError(
            f"host pool spec {hspec.name!r} and device pool spec {dspec.name!r} "
            "have different buffers, layers or row shapes"
        )
    counts = {"sm_budget": kernel.sm_budget, "rows_per_program": kernel.rows_per_program}
    counts |= {"stages": kernel.stages, "max_unit_bytes": kernel.max_unit_bytes}
    bad = {k: v for k, v in counts.items() if v is not None and (isinstance(v, bool) or v < 1)}
    if bad:
        raise ConfigError(f"kernel options must be positive, got {bad} in {kernel}")
    flags = {"lean": kernel.lean, "overlap": kernel.overlap}
    flags = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if flags:
        raise ConfigError(f"kernel options lean and overlap must be True or False, got {flags}")
    if costs.backup_staged_floor_bytes < 0:
        raise ConfigError(
            f"backup_staged_floor_bytes must not be negative, got {costs.backup_staged_floor_bytes}"
        )
    if not 0 <= costs.backup_copy_share < 1 or costs.copy_share_min_bytes < 0:
        share = (costs.backup_copy_share, costs.copy_share_min_bytes)
        raise ConfigError(f"backup_copy_share must be in [0, 1) and copy_share_min_bytes >= 0, got {share}")
    if costs.copy_streams < 1:
        raise ConfigError(f"copy_streams must be at least 1, got {costs.copy_streams}")
