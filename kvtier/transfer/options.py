"""What the planner is told: the paths it may be forced to (`TransferPath`), what it assumes each
mechanism costs (`PathCosts`) and how the kernel is shaped (`KernelOptions`); a `Planner` checks
them once (`check`). Where each default comes from: bench/FINDINGS.md, "The planner's costs".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvtier.errors import ConfigError, PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostPool
from kvtier.transfer import kernels
from kvtier.transfer.kernels import LINE_BYTES, KernelLaunch


class TransferPath(str, Enum):
    """What a plan does as a whole (for logs, benchmarks and `Planner`'s `force`): `COPY` (the copy
    engine, no SMs), `KERNEL` (the row kernel), `MIXED` (long joint runs copied, the rest by the
    kernel; never forced), `REFERENCE` (per token through host memory; synchronises the host)."""

    COPY = "copy"
    KERNEL = "kernel"
    MIXED = "mixed"
    REFERENCE = "reference"


# The kernel's share of the ceiling by contiguous piece bytes (`PathCosts.kernel_share`).
KERNEL_SHARE = ((128, 0.55), (256, 0.68), (512, 0.8), (1024, 0.9), (4096, 0.93))


@dataclass(frozen=True)
class PathCosts:
    """The planner's cost model: fixed costs per copy and per launch, and each mechanism's share of
    the link (the ceiling: one contiguous pinned copy), so a choice holds from 1k to 128k tokens.

    - `copy_fixed_s` per copy beyond its bytes, `copy_call_s` per batched call (a part's on a layer),
      `copy_host_s` the host's time to issue one copy of a batched call;
    - `copy_min_bytes`: runs shorter than this (of several) are copied only beside a longer one;
    - `launch_fixed_s`: a launch beyond its bytes; `split_s` more after copies of the same buffer;
    - `kernel_share`: `(piece bytes, share)` pairs, ascending: the kernel's rate against the ceiling
      on contiguous pieces of that size, log-linear between pairs, flat past the ends; `kernel_scale`
      a factor on every share (a host whose SMs read its memory slower: `probe`);
    - `python_copy_s`, `reference_gbps`: without the kernel, a torch copy per run against the
      per-token reference path (`rule.without_kernel`);
    - `copy_streams`: streams a layer's copies fan out over where runs average under
      `fan_out_below_bytes`."""

    copy_fixed_s: float = 0.05e-6
    copy_call_s: float = 15e-6
    copy_host_s: float = 0.5e-6
    copy_min_bytes: int = 32 << 10
    launch_fixed_s: float = 6e-6
    split_s: float = 20e-6
    kernel_share: tuple[tuple[int, float], ...] = KERNEL_SHARE
    python_copy_s: float = 10e-6
    reference_gbps: float = 3.0
    copy_streams: int = 8
    fan_out_below_bytes: int = 1 << 20
    kernel_scale: float = 1.0

    def kernel_rate(self, piece_bytes: np.ndarray | float) -> np.ndarray:
        """The kernel's share of the ceiling on pieces of `piece_bytes` (log-linear in `kernel_share`)."""
        sizes = np.log2([p for p, _ in self.kernel_share])
        shares = [s for _, s in self.kernel_share]
        return np.interp(np.log2(np.maximum(piece_bytes, 1)), sizes, shares) * self.kernel_scale


@dataclass(frozen=True)
class MeasuredCosts:
    """The planner's costs per direction (`of`), as `kvtier.transfer.probe` measures them, with
    what they were derived from (`evidence`: shares of the same-run ceiling by what was timed,
    `{"load": {...}, "backup": {...}}`)."""

    load: PathCosts
    backup: PathCosts
    evidence: dict = field(default_factory=dict, compare=False)

    def of(self, direction: Direction) -> PathCosts:
        return self.load if direction is Direction.LOAD else self.backup


@dataclass(frozen=True)
class KernelOptions:
    """The row kernel's budget and shape (the rules: `kvtier.transfer.kernels`): up to `sm_budget`
    programs of `rows_per_program` rows a tile (None: by row size) and `stages` tiles in flight
    (None: as shared memory holds, where pipelined); runs move in units of up to `max_unit_bytes`;
    with `lean`, long rows take only the programs that keep the grid's bytes in flight
    (`kernels.programs_for`). `launch` gives one launch's shape."""

    sm_budget: int = 8
    rows_per_program: int | None = None
    max_unit_bytes: int = 16 << 10
    lean: bool = True
    stages: int | None = None

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
        the host rows over a `wide` span (`kernels.is_wide`) or not."""
        shared = kernels.shared_bytes(device)
        return _launch(self, row_bytes, align_bytes, shared, direction is Direction.LOAD, wide)


@functools.lru_cache(maxsize=256)
def _launch(
    opts: KernelOptions, row_bytes: int, align_bytes: int, shared: int | None, gather: bool, wide: bool
) -> KernelLaunch:
    """`KernelOptions.launch` on a device with `shared` bytes per program, kept per argument set."""
    stages = kernels.stages_for(row_bytes, align_bytes, shared, opts.stages, gather)
    if opts.rows_per_program is not None or not opts.lean:
        programs = opts.sm_budget
    else:
        programs = kernels.programs_for(row_bytes, opts.sm_budget, stages, wide)
    rows = opts.rows_per_program or kernels.rows_in_flight(row_bytes, programs, stages)
    return KernelLaunch(programs, rows, stages)


def per_direction(costs: PathCosts | MeasuredCosts | None) -> MeasuredCosts:
    """`costs` as costs per direction (one `PathCosts` for both; None: the defaults)."""
    if isinstance(costs, MeasuredCosts):
        return costs
    if costs is not None and not isinstance(costs, PathCosts):
        raise ConfigError(f"costs must be PathCosts or MeasuredCosts, got {type(costs).__name__}")
    costs = costs or PathCosts()
    return MeasuredCosts(load=costs, backup=costs)


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
    if bad or not isinstance(kernel.lean, bool):
        raise ConfigError(f"kernel options must be positive and lean True or False, got {bad or kernel}")
    fixed = ("copy_fixed_s", "launch_fixed_s", "split_s", "python_copy_s", "copy_call_s", "copy_host_s")
    negative = {k: getattr(costs, k) for k in (*fixed, "copy_min_bytes") if getattr(costs, k) < 0}
    if negative or costs.reference_gbps <= 0:
        raise ConfigError(
            f"fixed costs must not be negative, nor reference_gbps zero, got {negative}, "
            f"reference_gbps {costs.reference_gbps}"
        )
    pieces, shares = [p for p, _ in costs.kernel_share], [s for _, s in costs.kernel_share]
    if not pieces or pieces != sorted(set(pieces)) or pieces[0] < 1 or not all(0 < s <= 1 for s in shares):
        raise ConfigError(
            f"kernel_share must be (piece bytes, share) pairs, pieces ascending and positive, "
            f"shares in (0, 1], got {costs.kernel_share}"
        )
    if not 0 < costs.kernel_scale <= 1:
        raise ConfigError(f"kernel_scale must be in (0, 1], got {costs.kernel_scale}")
    if costs.copy_streams < 1:
        raise ConfigError(f"copy_streams must be at least 1, got {costs.copy_streams}")
