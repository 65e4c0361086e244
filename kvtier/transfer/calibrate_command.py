"""`kvtier calibrate`: measure this GPU's transfer costs now, cache them, and show what the planner
then chooses for each spec's buffers (`kvtier.transfer.calibrate`)."""

from __future__ import annotations

import time
from argparse import Namespace

from rich.table import Table

from kvtier.errors import ConfigError
from kvtier.pool.device import Direction
from kvtier.transfer.costs import NEVER, CostModel
from kvtier.transfer.options import PathCosts

# The specs calibrated by default: every preset of a real model's shape.
DEFAULT_SPECS = (
    "llama-3.1-8b",
    "deepseek-v3",
    "deepseek-v3-fp8",
    "deepseek-v3-fp8-packed",
    "glm-5",
    "glm-5-fp8",
)


def command(args: Namespace) -> int:
    from kvtier.commands import console, device, write_json
    from kvtier.spec import preset
    from kvtier.transfer import calibrate

    dev = device(args.device)
    if dev.type != "cuda":
        raise ConfigError(f"kvtier calibrate measures a CUDA device; --device resolved to {dev}")
    specs = [preset(name) for name in (args.spec or DEFAULT_SPECS)]
    sizes = sorted({b.row_bytes for s in specs for b in s.buffers})
    t0 = time.perf_counter()
    model = calibrate.load_or_measure(dev, sizes, force=args.force)
    seconds = time.perf_counter() - t0
    path = calibrate.cache_file(dev)
    choices = {
        s.name: {
            b.name: {d.value: _choice(model, b.row_bytes, d, s.widest_row_bytes) for d in Direction}
            for b in s.buffers
        }
        for s in specs
    }
    console.print(_rates_table(model, sizes))
    console.print(_choices_table(choices))
    console.print(f"{model.source}: {seconds:.1f} s (cache: {path})")
    write_json(
        args.json,
        {"seconds": round(seconds, 2), "file": str(path), "model": model.to_json(), "choices": choices},
    )
    return 0


def _choice(model: CostModel, row_bytes: int, direction: Direction, widest: int) -> dict:
    c = model.planned(PathCosts(), row_bytes, direction, widest)
    if c is None:
        return {}
    return {
        k: None if v == NEVER else round(v)
        for k, v in (
            ("copy_min_bytes", c.copy_min_bytes),
            ("staged_min_bytes", c.staged_min_bytes),
            ("kernel_staged_below", c.kernel_staged_below),
        )
    }


def _rates_table(model: CostModel, sizes: list[int]) -> Table:
    t = Table(title="measured rates (GB/s; copy engine by piece: 32 KiB / 64 KiB / 256 KiB / 1 MiB)")
    for col in (
        "direction",
        "copy engine",
        "rows (B)",
        "staging pass",
        "staged, 64 KiB / 256 KiB runs",
        "kernel, rows",
        "kernel, units",
        "2-D lines",
    ):
        t.add_column(col, justify="right")
    for d, r in model.rates.items():
        pieces = " / ".join(f"{r.copy_gbps(p):.1f}" for p in (32 << 10, 64 << 10, 256 << 10, 1 << 20))
        for i, rb in enumerate(sizes):
            staged = " / ".join(f"{r.staged_gbps(rb, p):.1f}" for p in (64 << 10, 256 << 10))
            t.add_row(
                *((d.value, pieces) if i == 0 else ("", "")),
                str(rb),
                f"{r.device_pass.get(rb, 0):.0f}",
                staged if rb in r.staged else "",
                f"{r.kernel_rows.get(rb, 0):.1f}",
                f"{r.kernel_units.get(rb, 0):.1f}",
                f"{r.strided.get(rb, 0):.1f}",
            )
    return t


def _choices_table(choices: dict) -> Table:
    t = Table(title="the planner's choices by buffer (bytes of a run; - never)")
    for col in ("spec", "buffer", "direction", "copy from", "staged by copy from", "staged by kernel below"):
        t.add_column(col, justify="left" if col in ("spec", "buffer", "direction") else "right")
    for spec, bufs in choices.items():
        for name, by_dir in bufs.items():
            for d, c in by_dir.items():
                cells = [
                    ("-" if c.get(k) is None else f"{c[k]:,}")
                    for k in ("copy_min_bytes", "staged_min_bytes", "kernel_staged_below")
                ]
                t.add_row(spec, name, d, *cells)
    return t
