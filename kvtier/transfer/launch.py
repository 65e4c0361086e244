"""The row kernel's launch shape: how many programs, rows per tile and stages for rows of a size.

Rules (the measurements behind each constant: bench/FINDINGS.md):
- A gather over PCIe is bound by latency: the link fills only with about `GRID_BYTES` of reads in
  flight across the grid, which many outstanding loads per program reach, not many programs.
- Unpipelined, a program holds one tile of `GRID_BYTES / programs`, between `TILE_BYTES` and
  `MAX_TILE_BYTES`. Pipelined (gathers of whole `LINE_BYTES` lines at line-aligned offsets only),
  tiles are `TILE_BYTES` and up to `MAX_STAGES` are in flight, as shared memory holds them.
- Rows of `LEAN_ROW_BYTES` or more take the fewest programs that keep `GRID_BYTES` in flight;
  shorter rows are bound by the reads each SM issues and take the whole budget. Rows over a host
  span past `WIDE_SPAN_BYTES` in pieces under `WIDE_PIECE_BYTES` take twice the lean programs.
- One warp per `WARP_BYTES` of tile, at most `MAX_WARPS`.

`shared` arguments are the shared memory one program may use, in bytes; None where there is no
limit to plan for (off CUDA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvtier.transfer import kernel_args

GRID_BYTES = 512 * 1024
TILE_BYTES = 64 * 1024
MAX_TILE_BYTES = 128 * 1024
MAX_DEFAULT_ROWS = 256  # per TILE_BYTES of tile
MAX_STAGES = 4
SHARED_SLACK = 16 * 1024
LINE_BYTES = 128
LEAN_ROW_BYTES = 1024
WIDE_SPAN_BYTES = 512 << 20
WIDE_PIECE_BYTES = 4096
WARP_BYTES = 4096
MAX_WARPS = 32
# Vectors of one tile at most (one per thread position, up to 16 bytes each); 32 warps hold 16 each.
MAX_TILE_VECTORS = 16384
# The widest access one thread makes (a 16-byte vector load or store).
VECTOR_BYTES = 16


@dataclass(frozen=True)
class KernelLaunch:
    """One launch's shape: `programs` (SMs), `rows` per tile, `stages` tiles in flight per program."""

    programs: int
    rows: int
    stages: int


def pipelines(row_bytes: int, align_bytes: int, gather: bool = True) -> bool:
    """Whether rows of `row_bytes` at offsets that are multiples of `align_bytes` are pipelined."""
    return gather and row_bytes % LINE_BYTES == 0 and align_bytes % LINE_BYTES == 0


def tile_bytes(programs: int, stages: int = 1) -> int:
    """Bytes of rows per tile: `TILE_BYTES` pipelined, else `GRID_BYTES / programs` within bounds."""
    if stages > 1:
        return TILE_BYTES
    return max(TILE_BYTES, min(MAX_TILE_BYTES, GRID_BYTES // max(1, programs)))


def programs_for(row_bytes: int, sm_budget: int, stages: int = 1, wide: bool = False) -> int:
    """Programs for rows of `row_bytes` within `sm_budget` when each keeps `stages` tiles in flight,
    twice the lean count where the host rows are `wide` (`is_wide`: a wide span, short pieces)."""
    if row_bytes < LEAN_ROW_BYTES:
        return sm_budget
    per_program = TILE_BYTES * stages if stages > 1 else MAX_TILE_BYTES
    return min(sm_budget, -(-GRID_BYTES // per_program) * (2 if wide else 1))


def is_wide(span_bytes: int, piece_bytes: float) -> bool:
    """Whether host rows over `span_bytes` (first byte to last), in contiguous pieces of
    `piece_bytes` on average, take the wide grid (`programs_for`)."""
    return span_bytes > WIDE_SPAN_BYTES and piece_bytes < WIDE_PIECE_BYTES


def rows_in_flight(row_bytes: int, programs: int = 8, stages: int = 1) -> int:
    """Rows per tile: as many whole rows as `tile_bytes(programs, stages)` holds, at most
    `MAX_DEFAULT_ROWS` per `TILE_BYTES` of it."""
    tile = tile_bytes(programs, stages)
    return max(1, min(MAX_DEFAULT_ROWS * tile // TILE_BYTES, tile // row_bytes))


def stages_fit(shared: int | None, nbytes: int) -> int:
    """The most tiles of `nbytes` whose buffers fit in `shared` bytes of shared memory (one more
    than those that wait there; no limit where `shared` is None)."""
    if shared is None:
        return 1 << 30
    return max(1, 1 + (shared - SHARED_SLACK) // nbytes)


def stages_for(
    row_bytes: int, align_bytes: int, shared: int | None, stages: int | None = None, gather: bool = True
) -> int:
    """Tiles in flight per program: 1 where rows are not pipelined (`pipelines`), else `stages`
    (default `MAX_STAGES`) as far as `shared` bytes hold tiles of `TILE_BYTES`."""
    if not pipelines(row_bytes, align_bytes, gather):
        return 1
    return min(stages or MAX_STAGES, MAX_STAGES, stages_fit(shared, TILE_BYTES))


def warps_for(nbytes: int) -> int:
    """Warps of a program whose tile is `nbytes`: one per `WARP_BYTES`, 1 to `MAX_WARPS`."""
    return max(1, min(MAX_WARPS, nbytes // WARP_BYTES))


def shared_bytes(device: torch.device | None) -> int | None:
    """Shared memory one program may use on `device` (None off CUDA or without Triton: no limit)."""
    if device is None or device.type != "cuda" or kernel_args.triton is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_shared_bytes(index)


@functools.cache
def device_shared_bytes(index: int) -> int:
    """Shared memory one program may use on CUDA device `index` (opt-in maximum), in bytes."""
    return int(kernel_args.triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
