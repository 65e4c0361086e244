"""Which of one layer's parts run at once (`phases`), and the SMs a plan holds (`sms_held`).

The executor runs a layer's parts on two streams where a plan overlaps them: its direct kernel
parts (`KernelPart`) on a second stream, everything else on the caller's stream in plan order
(staged parts share the staging buffer, so they never run beside each other). Staging filled by
the kernel's units (`StagedPart.kernel`) runs beside the direct kernel parts only where their grids
together stay within `KernelOptions.sm_budget`, else before them: a plan never holds more SMs than
its budget. A plan does not overlap (None) without `KernelOptions.overlap`, without a direct
kernel part, or with nothing to run beside one.

Why: one layer's kernel rows and its copy-engine rows are disjoint, and one after the other the
link idles while the kernel's SMs wait on their read requests (bench/FINDINGS.md, "Overlapped parts").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvtier.transfer.options import KernelOptions
from kvtier.transfer.parts import CopyPart, KernelPart, Part, StagedPart


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
    if isinstance(part, StagedPart) and part.kernel is not None:
        grids = [r.launch.programs for windows in part.kernel.values() for rs in windows for r in rs]
        return max(grids, default=0)
    return 0


def phases(parts: Sequence[Part], kernel: KernelOptions) -> Phases | None:
    """How one layer of `parts` runs (the module docstring), or None where it runs in plan order."""
    if not kernel.overlap:
        return None
    side = tuple(p for p in parts if isinstance(p, KernelPart))
    others = tuple(p for p in parts if not isinstance(p, KernelPart))
    units = tuple(p for p in others if isinstance(p, StagedPart) and p.kernel is not None)
    rest = tuple(p for p in others if not (isinstance(p, StagedPart) and p.kernel is not None))
    engine = any(isinstance(p, (CopyPart, StagedPart)) for p in rest)
    fits = bool(units) and _widest(side) + _widest(units) <= kernel.sm_budget
    if not side or not (engine or fits):
        return None
    return Phases((), side, others) if fits else Phases(units, side, rest)


def sms_held(parts: Sequence[Part], split: Phases | None) -> int:
    """The most SMs `parts` hold at once, run as `split` says (`phases`): the widest launch, or the
    second stream's and the caller's widest together while they overlap."""
    alone = _widest(parts)
    return alone if split is None else max(alone, _widest(split.side) + _widest(split.beside))


def _widest(parts: Sequence[Part]) -> int:
    return max(map(programs, parts), default=0)
