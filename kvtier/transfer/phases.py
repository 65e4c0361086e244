"""Which of one layer's parts run at once (`phases`), and the SMs a plan holds (`sms_held`).

The executor runs a layer's parts on two streams where a plan overlaps them: its direct kernel
parts (`KernelPart`) on a second stream, everything else on the caller's stream in plan order
(staged parts share the staging buffer, so two run beside each other only in places apart).
Staging filled by the kernel's units (`StagedPart.kernel`) runs beside the direct kernel parts
where their grids together stay within `KernelOptions.sm_budget`; where they do not, it runs on
the second stream before the direct kernel parts, if its place in the staging buffer lies apart
from every other staged part's (`placed` moves it there at planning, `staging.units_apart`), else
before the fork: a plan never holds more SMs than its budget. A plan does not overlap (None)
without `KernelOptions.overlap`, without a direct kernel part, or with nothing to run beside one.

A load of direct kernel parts alone over several buffers (`glm-5` fully scattered: the latent and
the indexer of the same tokens) runs by buffer instead, where some buffer's launches take more
programs than the widest rows' (short rows, bound by the read requests each program keeps in
flight): the widest rows' launches on the second stream, those buffers' on the caller's stream
beside them, relaunched on the programs the first leave (`sm_budget` less their grid). Buffers
of equal launches (K and V) stay one after the other, on the few programs the planner gave them.
Backups stay in plan order: side by side they gained nothing steady.

Why: one layer's kernel rows and its copy-engine rows are disjoint, and one after the other the
link idles while the kernel's SMs wait on their read requests; so, too, while the indexer's
132-byte rows (two read requests each, ~0.5 of the ceiling alone) follow the latent's (bench/FINDINGS.md,
"Overlapped parts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvtier.pool.device import DevicePool, Direction
from kvtier.transfer import staging
from kvtier.transfer.options import KernelOptions
from kvtier.transfer.parts import CopyPart, KernelPart, KernelRegion, Part, StagedPart, by_units

if TYPE_CHECKING:
    from kvtier.transfer.plan import TransferPlan


class Phases(NamedTuple):
    """A layer's parts: `before` the fork (caller's stream), `side` (the second stream), and `beside`
    (the caller's stream, while `side` runs); each in plan order."""

    before: tuple[Part, ...]
    side: tuple[Part, ...]
    beside: tuple[Part, ...]


def programs(part: Part) -> int:
    """The largest grid of the part's kernel launches (0: no kernel)."""
    if isinstance(part, KernelPart):
        return part.programs
    if by_units(part):
        grids = [r.launch.programs for windows in part.kernel.values() for rs in windows for r in rs]
        return max(grids, default=0)
    return 0


def phases(plan: TransferPlan) -> Phases | None:
    """How each layer of `plan` runs (the module docstring), or None where it runs in plan order."""
    parts, kernel = plan.parts, plan.kernel
    if not kernel.overlap:
        return None
    side = tuple(p for p in parts if isinstance(p, KernelPart))
    others = tuple(p for p in parts if not isinstance(p, KernelPart))
    units = tuple(p for p in others if by_units(p))
    rest = tuple(p for p in others if not by_units(p))
    engine = any(isinstance(p, (CopyPart, StagedPart)) for p in rest)
    fits = _fit(side, units, kernel)
    row_bytes = {b.name: b.row_bytes for b in plan.host_pool.spec.buffers}
    if side and not others and plan.direction is Direction.LOAD:
        return _by_buffer(side, kernel, row_bytes, plan.device_pool.device)
    if not side or not (engine or fits):
        return None
    if fits:
        return Phases((), side, others)
    staged = [p for p in rest if isinstance(p, StagedPart)]
    if all(staging.disjoint(u, p, row_bytes) for u in units for p in staged):
        return Phases((), units + side, rest)
    return Phases(units, side, rest)


def placed(
    parts: tuple[Part, ...], kernel: KernelOptions, device_pool: DevicePool, direction: Direction
) -> tuple[Part, ...]:
    """`parts` with the staged parts the kernel's units fill in a place of their own
    (`staging.units_apart`), where the plan overlaps and their grid and the direct kernel parts' do not
    fit `sm_budget` together: so that they may run on the second stream, before the direct kernel
    parts (`phases`). Elsewhere `parts` as they are."""
    side = [p for p in parts if isinstance(p, KernelPart)]
    units = [p for p in parts if by_units(p)]
    if not (kernel.overlap and side and units) or _fit(side, units, kernel):
        return parts
    return staging.units_apart(parts, device_pool, direction)


def _fit(side: Sequence[Part], units: Sequence[Part], kernel: KernelOptions) -> bool:
    """Whether the kernel's units (`units`) run beside the direct kernel parts (`side`): there are
    some, and the two widest grids together stay within `sm_budget`."""
    return bool(units) and _widest(side) + _widest(units) <= kernel.sm_budget


def _by_buffer(
    side: tuple[KernelPart, ...],
    kernel: KernelOptions,
    row_bytes: Mapping[str, int],
    device: torch.device | None,
) -> Phases | None:
    """Loads of kernel parts alone: the launches of the widest rows, and of buffers whose launches take
    no more programs, on the second stream; the other buffers' (shorter rows, on more programs) beside
    them on the programs left (None: no such buffer, layer tables, or no program left)."""
    names = frozenset().union(*(p.buffers for p in side))
    if any(p.tables for p in side):
        return None
    grid = {n: max((r.launch.programs for p in side for r in p.regions.get(n, ())), default=0) for n in names}
    lead = max(names, key=lambda n: (row_bytes[n], n))
    wide = {n for n in names if grid[n] <= grid[lead]}
    first = tuple(_only(p, wide) for p in side if p.buffers & wide)
    left = kernel.sm_budget - _widest(first)
    if wide == names or left < 1:
        return None
    narrow = dataclasses.replace(kernel, sm_budget=left)
    beside = []
    for p in side:
        for n in sorted(p.buffers - wide):
            regions = tuple(_narrowed(r, narrow, row_bytes[n] * p.unit, device) for r in p.regions[n])
            beside.append(KernelPart(p.rows, p.unit, {n: regions}, {}))
    return Phases((), first, tuple(beside))


def _only(part: KernelPart, names: set[str] | frozenset[str]) -> KernelPart:
    """`part` for the buffers `names` alone."""
    return KernelPart(part.rows, part.unit, {n: rs for n, rs in part.regions.items() if n in names}, {})


def _narrowed(
    region: KernelRegion, opts: KernelOptions, unit_bytes: int, device: torch.device | None
) -> KernelRegion:
    """`region` launched as `opts` launches its units of `unit_bytes`, where that takes fewer programs."""
    launch = opts.launch(unit_bytes, region.align * region.word, device, Direction.LOAD, region.wide)
    return region if region.launch.programs <= launch.programs else dataclasses.replace(region, launch=launch)


def sms_held(parts: Sequence[Part], split: Phases | None) -> int:
    """The most SMs `parts` hold at once, run as `split` says (`phases`): the widest launch, or the
    second stream's and the caller's widest together while they overlap."""
    alone = _widest(parts)
    return alone if split is None else max(alone, _widest(split.side) + _widest(split.beside))


def _widest(parts: Sequence[Part]) -> int:
    return max(map(programs, parts), default=0)
