"""What `kvtier bench transfer` records of a run beside its rows (`metadata`): the machine, the spec and
layout, the sizes, the kernel's shape in words, the timing method and the same-run ceilings; and the
stock-style kernel it times against (`STOCK_KERNEL`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.bench.common import environment
from kvtier.pool.device import Direction
from kvtier.transfer import KernelOptions, kernels

if TYPE_CHECKING:
    from kvtier.bench.transfer import BenchConfig

# The stock-style kernel: two blocks, a few rows in flight each (one per warp), not pipelined.
STOCK_KERNEL = KernelOptions(sm_budget=2, rows_per_program=4, max_unit_bytes=1, stages=1)


def kernel_text(opts: KernelOptions, device: torch.device) -> str:
    """The kernel's shape in words: `8 programs x 56 rows`, or how it is chosen."""
    if opts.rows_per_program is not None:
        return f"{opts.sm_budget} programs x {opts.rows_per_program} rows"
    lines = opts.launch(kernels.LEAN_ROW_BYTES, kernels.LINE_BYTES, device)
    other = opts.launch(kernels.LEAN_ROW_BYTES + 16, 16, device)
    return (
        f"{opts.sm_budget} programs x rows by size; rows of {kernels.LEAN_ROW_BYTES} bytes or more: loads "
        f"of whole 128-byte lines on {lines.programs} programs of {lines.stages} tiles in flight, others "
        f"on {other.programs} of {other.stages}"
    )


def metadata(cfg: BenchConfig, ceilings: dict[Direction, float], layer_bytes: int) -> dict:
    """The run's metadata (the module docstring), JSON-ready."""
    return {
        **environment(cfg.device),
        "spec": cfg.spec.name,
        "buffers": {b.name: b.row_bytes for b in cfg.spec.buffers_on(0)},
        "page_size": cfg.spec.page_size,
        "layout": cfg.layout.value,
        "tokens": cfg.tokens,
        "layers": cfg.layers,
        "host_slots": cfg.pool_slots,
        "layer_bytes": layer_bytes,
        "churn_cycles": cfg.cycles,
        "kernel": kernel_text(cfg.kernel, cfg.device),
        "stock_kernel": f"{STOCK_KERNEL.sm_budget} programs x {STOCK_KERNEL.rows_per_program} rows",
        "timing": f"median of {cfg.repeats} x {cfg.batch} back-to-back calls (slow variants: 3 x 1)"
        + ("; the stream held by a GPU sleep while they are issued" if cfg.device.type == "cuda" else ""),
        "ceiling_gbps": {d.value: round(g, 2) for d, g in ceilings.items()},
    }
