"""The Triton kernel that copies scattered KV rows between pinned host memory and the GPU.

A launch moves `n` rows of `row_vecs` vectors, each at its own word offset, between 1-D words
tensors: a gather (load) reads pinned host memory over PCIe, a scatter (backup) writes it. A tile
of `ROWS_PER_BLOCK` rows is loaded whole before it is stored; the grid is persistent, so the copy
holds `min(programs, tiles)` SMs; gathers of whole 128-byte lines are pipelined over `STAGES` tiles.
`prepare_rows` shapes one launch (`RowLaunch`) from host-side offsets by the rules below; the plan
executor or the compiled loop runs it per layer.

Contract: row `i` copies `src[src_off[i] : + row words]` to `dst[dst_off[i] : ...]` bit for bit,
the source rows not overlapping the destination rows (the planner's slots are distinct); launched
on a stream, it never waits for the GPU. Words are the widest (up to 8 bytes) that the row size,
the base addresses and every offset allow; vectors 16 bytes where they allow it.

The launch shape (the measurements behind each constant: bench/FINDINGS.md):
- A gather over PCIe is bound by latency: the link fills only with about `GRID_BYTES` of reads in
  flight across the grid, which many outstanding loads per program reach, not many programs.
- Unpipelined, a program holds one tile of `GRID_BYTES / programs`, between `TILE_BYTES` and
  `MAX_TILE_BYTES`. Pipelined (gathers of whole `LINE_BYTES` lines at line-aligned offsets only),
  tiles are `TILE_BYTES` and up to `MAX_STAGES` are in flight, as shared memory holds them.
- Rows of `LEAN_ROW_BYTES` or more take the fewest programs that keep `GRID_BYTES` in flight;
  shorter rows are bound by the reads each SM issues and take the whole budget. Rows over a host
  span past `WIDE_SPAN_BYTES` in pieces under `WIDE_PIECE_BYTES` take twice the lean programs.
- One warp per `WARP_BYTES` of tile, at most `MAX_WARPS`.
`shared` arguments: the shared memory one program may use, in bytes (None off CUDA: no limit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.errors import TransferError
from kvtier.jit import ModeJit, launch_on, next_power_of_2, tl, triton
from kvtier.jit import runs_on as runs_on  # the row kernel runs where Triton does

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
    return TILE_BYTES if stages > 1 else max(TILE_BYTES, min(MAX_TILE_BYTES, GRID_BYTES // max(1, programs)))


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
    return 1 << 30 if shared is None else max(1, 1 + (shared - SHARED_SLACK) // nbytes)


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
    if device is None or device.type != "cuda" or triton is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return device_shared_bytes(index)


@functools.cache
def device_shared_bytes(index: int) -> int:
    """Shared memory one program may use on CUDA device `index` (opt-in maximum), in bytes."""
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def word_size(row_bytes: int, aligns: list[int]) -> int:
    """The widest word size (8, 4, 2, 1) dividing `row_bytes` and every value of `aligns`."""
    bits = row_bytes
    for a in aligns:
        bits |= a
    return next(size for size in (8, 4, 2, 1) if bits % size == 0)


def common_alignment(*offsets: np.ndarray) -> int:
    """The largest power of two (up to 2**20) dividing every value of `offsets` (`[m]` int64 each)."""
    acc = 0
    for o in offsets:
        if len(o):
            acc |= int(np.bitwise_or.reduce(o))
    return acc & -acc if acc else 1 << 20


def _copy_vectors(src_ptr, dst_ptr, s, d, mask, VEC: tl.constexpr):
    """Copy one vector of `VEC` words per position: word offsets `s` to `d` (`[BLOCK]` each)."""
    k = tl.arange(0, VEC)
    m2 = mask[:, None]
    # Every vector of the tile is loaded before any is stored: the whole tile is in flight.
    vals = tl.load(src_ptr + (s[:, None] + k[None, :]), mask=m2)
    tl.store(dst_ptr + (d[:, None] + k[None, :]), vals, mask=m2)


def _copy_rows_kernel(
    src_ptr,
    src_off_ptr,
    dst_ptr,
    dst_off_ptr,
    n_rows,
    row_vecs,
    ROWS_PER_BLOCK: tl.constexpr,
    ROWS_POW: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Persistent grid: program `pid` copies tiles `pid, pid + num_programs, ...` (module docstring)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(n_rows, ROWS_PER_BLOCK)
    vector = tl.arange(0, BLOCK)
    in_block = vector < ROWS_PER_BLOCK * row_vecs
    for block in tl.range(pid, num_blocks, num_programs, num_stages=STAGES):
        # Each vector's row and word offset in it, per tile: holding them across tiles costs registers.
        rows = block * ROWS_PER_BLOCK + vector // row_vecs
        mask = in_block & (rows < n_rows)
        w = (vector % row_vecs) * VEC
        if STAGES > 1:
            first = block * ROWS_PER_BLOCK
            r = first + tl.arange(0, ROWS_POW)
            row_mask = (r < first + ROWS_PER_BLOCK) & (r < n_rows)
            src_rows = tl.load(src_off_ptr + r, mask=row_mask, other=0)
            dst_rows = tl.load(dst_off_ptr + r, mask=row_mask, other=0)
            # Vectors past the rows read the last row's offsets, masked off.
            spread = tl.minimum(vector // row_vecs, ROWS_POW - 1)
            s = tl.gather(src_rows, spread, 0)
            d = tl.gather(dst_rows, spread, 0)
        else:
            s = tl.load(src_off_ptr + rows, mask=mask, other=0)
            d = tl.load(dst_off_ptr + rows, mask=mask, other=0)
        if VEC == 1:
            _copy_vectors_jit(src_ptr, dst_ptr, s + w, d + w, mask, VEC)
        else:
            # Offsets are multiples of VEC (the host saw them all): no per-tile check.
            s_vec = tl.multiple_of(s + w, VEC)
            d_vec = tl.multiple_of(d + w, VEC)
            _copy_vectors_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)


# Bound by `_kernel` (`ModeJit`): the Triton-wrapped `_copy_vectors` that the kernel calls.
_copy_vectors_jit: Any = None
# n_rows changes with every call: one compiled kernel serves all of them.
_kernel = ModeJit(_copy_rows_kernel, _copy_vectors, do_not_specialize=["n_rows"])


def row_kernel() -> Any:
    """The Triton row kernel (jitted for the current mode)."""
    return _kernel()


@dataclass(frozen=True)
class RowShape:
    """How the kernel moves rows of one size: `word` bytes per word, `row_vecs` vectors per row,
    `rows` per tile and the kernel's keyword arguments."""

    word: int
    row_vecs: int
    rows: int
    programs: int
    kwargs: dict[str, Any]

    def grid(self, n: int) -> int:
        return min(self.programs, -(-n // self.rows))

    @classmethod
    def of(
        cls,
        row_bytes: int,
        size: int,
        bases: list[int],
        offset_bytes: int,
        gather: bool,
        device: torch.device,
        sm_budget: int,
        rows_per_program: int | None,
        stages: int | None,
    ) -> RowShape:
        """The shape for rows of `row_bytes` in words of at most `size` bytes, between base addresses
        `bases`, at byte offsets that are all multiples of `offset_bytes`; `gather`: the rows are read
        from the host."""
        # Widest words the row size, the base addresses and every offset are multiples of.
        known = min(VECTOR_BYTES, offset_bytes)
        width = word_size(row_bytes, [*bases, known])
        row_w = row_bytes // width
        every = functools.reduce(int.__or__, bases, offset_bytes)
        line = pipelines(row_bytes, every & -every if every else LINE_BYTES, gather)
        stages = (stages or MAX_STAGES) if line else 1
        if rows_per_program is None:
            rows_per_program = rows_in_flight(row_bytes, sm_budget, stages)
        vec = 1
        wider = vec * 2
        while wider * width <= VECTOR_BYTES and row_w % wider == 0 and known % (wider * width) == 0:
            vec, wider = wider, wider * 2
        row_vecs = row_w // vec
        if row_vecs > MAX_TILE_VECTORS:
            raise TransferError(
                f"rows of {row_bytes} bytes in {row_vecs} vectors of {vec * width} bytes are wider than one "
                f"tile of the kernel ({MAX_TILE_VECTORS} vectors); split them into narrower rows"
            )
        rows = min(rows_per_program, MAX_TILE_VECTORS // row_vecs)
        block = next_power_of_2(rows * row_vecs)
        tile = block * vec * width
        stages = min(stages, stages_fit(shared_bytes(device), tile))
        kwargs = {"ROWS_PER_BLOCK": rows, "ROWS_POW": next_power_of_2(rows), "BLOCK": block, "VEC": vec}
        kwargs |= {"STAGES": stages, "num_warps": warps_for(tile), "num_stages": stages}
        return cls(width, row_vecs, rows, sm_budget, kwargs)


@dataclass(frozen=True)
class RowLaunch:
    """One prepared launch: `n` rows at word offsets `src_off`, `dst_off` (`[n]` int64 on the kernel's
    device, words of `shape.word` bytes) from and to bases given per call (`run`); shaped once, run
    per layer (on CUDA the compiled loop launches it itself: `compiled`)."""

    n: int
    shape: RowShape
    src_off: torch.Tensor
    dst_off: torch.Tensor

    def run(self, views: Callable[[], tuple[torch.Tensor, torch.Tensor]], stream: int | None = None) -> None:
        """Move the rows between `views()`, the bases as 1-D words tensors of `shape.word` bytes (one on
        the GPU, the other pinned host memory; under the interpreter both on the CPU), on raw CUDA
        stream `stream` (None: the current one)."""
        if self.n == 0:
            return
        device, shape = self.src_off.device, self.shape
        s, d = views()
        args = (s, self.src_off, d, self.dst_off, self.n, shape.row_vecs)
        if device.type != "cuda" or stream is None:
            launch_on(device, _kernel(), shape.grid(self.n), args, shape.kwargs)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
            launch_on(device, _kernel(), shape.grid(self.n), args, shape.kwargs)


def prepare_rows(
    row_bytes: int,
    src_off: np.ndarray,
    dst_off: np.ndarray,
    bases: list[int],
    gather: bool,
    device: torch.device,
    programs: int,
    rows_per_program: int | None,
    stages: int | None,
    upload: Callable[[torch.Tensor], torch.Tensor],
) -> RowLaunch:
    """A `RowLaunch` of rows of `row_bytes` at byte offsets `src_off`, `dst_off` (`[n]` int64 numpy)
    from bases whose addresses are `bases` (every base the launch will run with), read from the host
    where `gather`; `upload` puts the word offsets on `device`."""
    size = 8
    while row_bytes % size:
        size //= 2
    align = common_alignment(src_off, dst_off)
    shape = RowShape.of(row_bytes, size, bases, align, gather, device, programs, rows_per_program, stages)
    w = shape.word
    # One upload of both, each row 16-byte aligned as Triton's compiled kernels assume.
    n = len(src_off)
    both = np.zeros((2, n + n % 2), dtype=np.int64)
    both[0, :n], both[1, :n] = src_off // w, dst_off // w
    both_t = upload(torch.from_numpy(both))
    return RowLaunch(n, shape, both_t[0, :n], both_t[1, :n])
