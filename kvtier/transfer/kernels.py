"""A Triton kernel that copies scattered KV rows between pinned host memory and the GPU.

What this module owns
---------------------
`copy_rows` moves `n` equally sized rows, each at its own word offset, from one 1-D
words tensor to another. The same kernel serves both directions:

- gather (load), host -> device: `src` is pinned CPU memory, `dst` is on the GPU;
- scatter (backup), device -> host: `src` is on the GPU, `dst` is pinned CPU memory.

The GPU reads or writes the pinned host pages directly over PCIe (a pinned tensor's
pointer is valid on the GPU through unified virtual addressing), so no staging
buffer and no copy-engine call per run of rows is needed. This is the path for
scattered rows (short runs), where the copy engine pays a fixed cost per run.

Why rows in flight matter
-------------------------
A gather over PCIe is latency-bound, not bandwidth-bound: one read of host memory
takes on the order of a microsecond to come back, so reaching ~50 GB/s needs on
the order of 512 KiB in flight across the GPU at any time (measured). Many
programs are not the way to get there; many outstanding loads per program are.
Each program therefore loads a whole tile of rows (`rows_per_program` rows, flattened
into 16-byte chunks, one per lane; see `rows_in_flight`) before it stores any of it. A
gather of rows that are whole 128-byte lines is also pipelined (`pipelines`): while one
tile of 64 KiB is stored, the next `stages - 1` are already on their way into shared
memory (asynchronous copies, which hold no registers), so a program keeps up to
`MAX_STAGES` tiles (256 KiB) in flight; other launches hold one tile of 64-128 KiB. The
grid is persistent and small: exactly `min(sm_budget, number of row blocks)` programs,
each looping over the row blocks `pid, pid + num_programs, ...`. The copy takes
`sm_budget` SMs (default 8) from the model running beside it, and no more. Each SM it
holds cost a bf16 matmul beside it about 1% of its rate on an H200 (bench/NOTES.md), so
rows that fill the link from fewer programs get fewer: rows of 1 KiB or more take 2
programs pipelined, 4 otherwise (`programs_for`, used by `KernelOptions` unless told
otherwise).

Contract
--------
- Row `i` copies words `src[src_offsets[i] : src_offsets[i] + row_words]` to
  `dst[dst_offsets[i] : dst_offsets[i] + row_words]`, bit for bit.
- `src` and `dst` are 1-D, contiguous, of the same integer words dtype (int64,
  int32, int16 or uint8; see `kvtier.pool.rows.as_words`). Source rows must not
  overlap destination rows (unchecked; the two are different tiers in practice).
- The offset tensors are `[n]` int64, on the GPU in real use (CPU offsets are
  uploaded through pinned memory without blocking; under Triton's CPU interpreter
  everything is on the CPU).
- With `validate=True` (the default) every check runs on the host before anything
  is launched, so a bad call leaves the destination untouched: bounds of every row,
  overlapping (e.g. repeated) destination rows. That needs the offsets on the CPU;
  callers holding device offsets validate their CPU indices themselves and pass
  `validate=False`. Cheap metadata checks (dtypes, shapes, lengths) always run.
- The kernel is launched on the current CUDA stream; `copy_rows` never waits for
  the GPU and reads no device value back to the host.
- Accesses are made as wide as the data allows. The wrapper re-views the words at
  the widest width (up to 8 bytes) dividing the row size, both base addresses and,
  when the offsets are on the CPU, every offset (offsets on the GPU are not read
  back, so there the given words are never widened: pass `as_words` views). The
  kernel then uses 16-byte vector accesses where the offsets allow: known on the
  host (CPU offsets, or `offsets_align`), or else checked on the GPU per tile.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch

from kvtier.errors import SlotError
from kvtier.pool.rows import flat_words

try:  # Triton is optional: without it `copy_rows` raises and `triton_available()` is False.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = [
    "LEAN_ROW_BYTES",
    "LINE_BYTES",
    "MAX_STAGES",
    "copy_rows",
    "pipelines",
    "programs_for",
    "rows_in_flight",
    "runs_on",
    "stages_for",
    "stages_on",
    "tile_bytes",
    "triton_available",
    "warps_for",
]

_WORD_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_WORD_SIZES: dict[torch.dtype, int] = {dtype: size for size, dtype in _WORD_DTYPES.items()}

# Bytes in flight per program by default: a gather of host rows needs ~512 KiB of reads
# outstanding across the grid to fill the link (an H200, bench/NOTES.md). Unpipelined, a
# program holds one tile of `_GRID_BYTES / programs`, from 64 KiB (8 programs or more) to 128
# KiB (4 or fewer, the most its registers hold); pipelined, tiles of 64 KiB, `stages` of them.
_GRID_BYTES = 512 * 1024
_TILE_BYTES = 64 * 1024
_MAX_TILE_BYTES = 128 * 1024
_MAX_DEFAULT_ROWS = 256  # per 64 KiB of tile
# Lanes of one tile at most (one chunk of up to 16 bytes each); 32 warps hold 16 each.
MAX_TILE_CHUNKS = 16384
# Tiles in flight per program when pipelined: one in registers, up to three more in shared
# memory (3 x 64 KiB of an H200's 227 KiB per block), as far as the device's shared memory holds.
MAX_STAGES = 4
# Shared memory the kernel needs beside its stages' buffers (the offsets' spreading, layouts):
# 3.5-14 KiB compiled for sm_90 with rows of 256 B to 16 KiB.
_SHARED_SLACK = 16 * 1024
# Only rows of whole 128-byte lines, at line-aligned offsets, are pipelined: asynchronous copies
# of host rows that straddle lines ran at half the rate of plain loads (656-byte rows 0.45 of the
# ceiling against 0.86; 2112-byte pages 0.84 against 0.91; an H200, bench/NOTES.md).
LINE_BYTES = 128
# Rows of at least LEAN_ROW_BYTES fill the link from the fewest programs that keep `_GRID_BYTES`
# in flight (2 pipelined: 0.93 of the ceiling for 1152-byte rows on an H200; 4 unpipelined, 0.92;
# as on 8), and each SM the kernel holds costs a matmul beside it ~1% of its rate; shorter rows
# are bound by the reads each SM issues and take the whole budget (656-byte rows: 0.83 on 4
# programs, 0.85 on 8; 132-byte rows: 0.34 on 4, 0.52 on 8).
LEAN_ROW_BYTES = 1024
# One warp per this many bytes of tile, at most `_MAX_WARPS` (1024 threads).
_WARP_BYTES = 4096
_MAX_WARPS = 32
# Widest access per thread the hardware has (a 16-byte vector load/store).
VECTOR_BYTES = 16


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(device: torch.device) -> bool:
    """Whether `copy_rows` can run with its device-side tensor on `device` here."""
    return triton is not None and (device.type == "cuda" or interpreting())


def pipelines(row_bytes: int, align_bytes: int, gather: bool = True) -> bool:
    """Whether rows of `row_bytes` at offsets that are multiples of `align_bytes` are pipelined.

    Only gathers (host reads, whose latency the pipeline hides) of whole 128-byte lines are.
    """
    return gather and row_bytes % LINE_BYTES == 0 and align_bytes % LINE_BYTES == 0


def tile_bytes(programs: int, stages: int = 1) -> int:
    """Bytes of rows per tile: 64 KiB pipelined (`stages` > 1), else `_GRID_BYTES / programs`, 64-128 KiB."""
    if stages > 1:
        return _TILE_BYTES
    return max(_TILE_BYTES, min(_MAX_TILE_BYTES, _GRID_BYTES // max(1, programs)))


def programs_for(row_bytes: int, sm_budget: int, stages: int = 1) -> int:
    """Programs for rows of `row_bytes` within `sm_budget` when each keeps `stages` tiles in flight.

    Rows of `LEAN_ROW_BYTES` or more take the fewest programs that keep ~512 KiB in flight:
    2 with 4 stages of 64 KiB, 4 unpipelined (tiles of 128 KiB); shorter rows the budget.
    """
    if row_bytes < LEAN_ROW_BYTES:
        return sm_budget
    per_program = _TILE_BYTES * stages if stages > 1 else _MAX_TILE_BYTES
    return min(sm_budget, -(-_GRID_BYTES // per_program))


def rows_in_flight(row_bytes: int, programs: int = 8, stages: int = 1) -> int:
    """Rows per tile for rows of `row_bytes` on a grid of `programs` keeping `stages` tiles each.

    As many whole rows as fit in `tile_bytes(programs, stages)` (and at most
    `_MAX_DEFAULT_ROWS` per 64 KiB of it): with 8 programs, or pipelined, 56 for 1152-byte
    rows, 99 for 656, 256 for 132; unpipelined on 4 programs 113, 199 and 512. What matters
    for a gather over PCIe is bytes in flight: a CUDA probe on an H200 (bench/NOTES.md)
    reached the SM read plateau (~51 GB/s) once ~512 KiB were outstanding across the grid,
    and fell to 0.66-0.75 of it with half that.
    """
    tile = tile_bytes(programs, stages)
    return max(1, min(_MAX_DEFAULT_ROWS * tile // _TILE_BYTES, tile // row_bytes))


def stages_for(
    row_bytes: int,
    align_bytes: int,
    device: torch.device | None,
    stages: int | None = None,
    gather: bool = True,
) -> int:
    """Tiles in flight per program for rows of `row_bytes` at `align_bytes`-aligned offsets on `device`.

    1 (no pipelining) for scatters and for rows that are not whole, aligned 128-byte lines;
    else `stages` (default `MAX_STAGES`), at most what the device's shared memory holds
    (`stages_on`).
    """
    if not pipelines(row_bytes, align_bytes, gather):
        return 1
    return min(stages or MAX_STAGES, stages_on(device))


@functools.cache
def _shared_bytes(index: int) -> int:
    """Shared memory one program may use on CUDA device `index` (opt-in maximum), in bytes."""
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def stages_on(device: torch.device | None, nbytes: int = _TILE_BYTES) -> int:
    """Tiles of `nbytes` a program can keep in flight on `device`: `MAX_STAGES` at most.

    All but one wait in shared memory, so a device with less of it pipelines fewer (an
    H200's 227 KiB holds three 64 KiB tiles; an A100's 163 KiB two). Off CUDA (Triton's
    interpreter runs tiles one by one, or planning on the CPU) plans are made as for a
    device that holds `MAX_STAGES`.
    """
    return min(MAX_STAGES, _stages_fit(device, nbytes))


def _stages_fit(device: torch.device | None, nbytes: int) -> int:
    """The most stages whose buffers fit in `device`'s shared memory (no limit off CUDA)."""
    if device is None or device.type != "cuda" or triton is None:
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, 1 + (_shared_bytes(index) - _SHARED_SLACK) // nbytes)


def warps_for(nbytes: int) -> int:
    """Warps of a program whose tile is `nbytes`: one per 4 KiB, 1 to 32.

    A 64 KiB tile runs on 16 warps (8 lanes of 16 bytes per thread, no spills); a 128 KiB
    tile on 32 (on 16 it spilled 56 registers, and beside a matmul on an H200 it cost the
    matmul 7% of its rate on 4 SMs where 32 warps cost 4%; bench/NOTES.md).
    """
    return max(1, min(_MAX_WARPS, nbytes // _WARP_BYTES))


def triton_available() -> bool:
    """Whether `copy_rows` can run here: Triton imports, and CUDA or Triton's CPU interpreter is on."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


# ---------------------------------------------------------------------------
# The kernel. Its bodies are plain functions, turned into Triton kernels on first
# use (`_kernel`), so that whether they run compiled or under the interpreter is
# decided by TRITON_INTERPRET at that time, not when this module was imported.
# ---------------------------------------------------------------------------


def _copy_chunks(src_ptr, dst_ptr, s, d, mask, VEC: tl.constexpr):
    """Copy one chunk of `VEC` words per lane: word offsets `s` to `d` (`[BLOCK]` each)."""
    k = tl.arange(0, VEC)
    m2 = mask[:, None]
    # Every chunk of the tile is loaded before any is stored: the whole tile is in flight.
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
    CHECK_ALIGN: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Persistent grid: program `pid` copies row blocks `pid, pid + num_programs, ...`.

    A row is `row_vecs` chunks of `VEC` words. A row block is `ROWS_PER_BLOCK` rows,
    flattened into `ROWS_PER_BLOCK * row_vecs` chunks (row-major), one lane each;
    `BLOCK` is that rounded up to a power of two, the lanes past it masked off. So
    a tile holds whole rows back to back with no padding per row, and its bytes in
    flight are the rows' bytes, whatever the row size.

    With `STAGES` > 1 the loop is pipelined over `STAGES` tiles: on a GPU the loads of the
    next `STAGES - 1` tiles go out as asynchronous copies into shared memory while the
    current one is stored, so a program keeps `STAGES` tiles in flight with one tile's
    registers. The rows' offsets are then loaded once per row (`ROWS_POW`:
    `ROWS_PER_BLOCK` rounded up to a power of two) and spread over their lanes in
    registers, so that only the rows' bytes wait in shared memory; unpipelined, each lane
    loads its row's offsets.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(n_rows, ROWS_PER_BLOCK)
    lane = tl.arange(0, BLOCK)
    in_block = lane < ROWS_PER_BLOCK * row_vecs
    for block in tl.range(pid, num_blocks, num_programs, num_stages=STAGES):
        # Row of each lane, and word offset of its chunk within the row (a multiple of VEC):
        # computed per tile, as holding them across tiles costs registers.
        rows = block * ROWS_PER_BLOCK + lane // row_vecs
        mask = in_block & (rows < n_rows)
        w = (lane % row_vecs) * VEC
        if STAGES > 1:
            first = block * ROWS_PER_BLOCK
            r = first + tl.arange(0, ROWS_POW)
            row_mask = (r < first + ROWS_PER_BLOCK) & (r < n_rows)
            src_rows = tl.load(src_off_ptr + r, mask=row_mask, other=0)
            dst_rows = tl.load(dst_off_ptr + r, mask=row_mask, other=0)
            # Lanes past the rows read the last row's offsets, masked off.
            spread = tl.minimum(lane // row_vecs, ROWS_POW - 1)
            s = tl.gather(src_rows, spread, 0)
            d = tl.gather(dst_rows, spread, 0)
        else:
            s = tl.load(src_off_ptr + rows, mask=mask, other=0)
            d = tl.load(dst_off_ptr + rows, mask=mask, other=0)
        if VEC == 1:
            _copy_chunks_jit(src_ptr, dst_ptr, s + w, d + w, mask, VEC)
        elif not CHECK_ALIGN:
            # Every offset is a multiple of VEC (known on the host): no check, and no
            # reduction that makes the warps of a program wait for each other per tile.
            s_vec = tl.multiple_of(s + w, VEC)
            d_vec = tl.multiple_of(d + w, VEC)
            _copy_chunks_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
        else:
            # The offsets are not known on the host (they live on the GPU and no alignment
            # was promised), so the alignment for VEC-word vectors is checked per tile: a
            # reduction over the tile, after which its warps wait for each other.
            misaligned = tl.max((s | d) & (VEC - 1), axis=0)
            if misaligned == 0:
                # Equal to s + w and d + w here; written so the compiler sees multiples of VEC.
                s_vec = tl.multiple_of((s // VEC) * VEC + w, VEC)
                d_vec = tl.multiple_of((d // VEC) * VEC + w, VEC)
                _copy_chunks_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
            else:
                _copy_chunks_jit(src_ptr, dst_ptr, s + w, d + w, mask, VEC)


class ModeJit:
    """`triton.jit(fn, **options)` for the current mode, wrapped again when the mode changes.

    Triton reads TRITON_INTERPRET when a function is wrapped, so kernels are wrapped on first
    use, not at import, and again if the interpreter is switched on or off.
    """

    def __init__(self, fn: Any, **options: Any) -> None:
        self.fn, self.options = fn, options
        self.jit: Any = None
        self.mode: bool | None = None

    def __call__(self) -> Any:
        mode = interpreting()
        if self.jit is None or self.mode != mode:
            self.jit, self.mode = triton.jit(self.fn, **self.options), mode
        return self.jit


# The Triton-wrapped `_copy_chunks`, which `_copy_rows_kernel` calls by this name (set by `_kernel`).
_copy_chunks_jit: Any = None
_chunks = ModeJit(_copy_chunks)
# n_rows changes with every call: one compiled kernel serves all of them.
_rows = ModeJit(_copy_rows_kernel, do_not_specialize=["n_rows"])


def _kernel() -> Any:
    """The Triton kernel for the current mode (compiled, or Triton's CPU interpreter)."""
    global _copy_chunks_jit
    _copy_chunks_jit = _chunks()
    return _rows()


# ---------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def check_words(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _WORD_SIZES:
        raise ValueError(f"{name} must be a words tensor (int64, int32, int16 or uint8), got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be 1-D and contiguous, got shape {tuple(t.shape)} stride {t.stride()}")


def check_count(name: str, value: Any, *, least: int = 1, optional: bool = False) -> None:
    """`value` is an int (not a bool) of at least `least` (1 or 0), or None where `optional`."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive int" if least == 1 else "a non-negative int"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")


def check_offsets(offsets: torch.Tensor, name: str) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise SlotError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.dtype != torch.int64:
        raise SlotError(f"{name} must be 1-D int64, got shape {tuple(offsets.shape)} dtype {offsets.dtype}")


def validate_rows(offsets: torch.Tensor, row_words: int, numel: int, name: str) -> None:
    """Every row `[offset, offset + row_words)` lies inside `[0, numel)`."""
    lo = int(offsets.min())
    hi = int(offsets.max())
    if lo < 0 or hi + row_words > numel:
        bad = offsets[(offsets < 0) | (offsets + row_words > numel)]
        raise SlotError(
            f"{name}: rows of {row_words} words at offsets {bad[:8].tolist()}"
            f"{' ...' if bad.numel() > 8 else ''} fall outside a tensor of {numel} words"
        )


def validate_disjoint(offsets: torch.Tensor, row_words: int, name: str) -> None:
    """No two rows `[offset, offset + row_words)` overlap (repeated offsets included)."""
    if offsets.numel() < 2:
        return
    ordered = offsets.sort().values
    gaps = ordered[1:] - ordered[:-1]
    clash = torch.nonzero(gaps < row_words).flatten()
    if clash.numel():
        i = int(clash[0])
        a, b = int(ordered[i]), int(ordered[i + 1])
        what = "is repeated" if a == b else f"overlaps the row at {a}"
        raise SlotError(
            f"{name}: destination row at offset {b} {what} (rows of {row_words} words); "
            f"{clash.numel()} overlapping pair(s) in all"
        )


def word_size(row_bytes: int, aligns: list[int]) -> int:
    """The widest word size (8, 4, 2, 1) dividing `row_bytes` and every value of `aligns`."""
    bits = row_bytes
    for a in aligns:
        bits |= a
    for size in (8, 4, 2, 1):
        if bits % size == 0:
            return size
    raise AssertionError("unreachable: 1 divides everything")


def _rescale(offsets: torch.Tensor, from_size: int, to_size: int) -> torch.Tensor:
    if from_size == to_size:
        return offsets
    if from_size > to_size:
        return offsets * (from_size // to_size)
    return torch.div(offsets, to_size // from_size, rounding_mode="floor")


def common_alignment(*offsets: np.ndarray) -> int:
    """The largest power of two (up to 2**20) dividing every value of `offsets` (`[m]` int64 each)."""
    acc = 0
    for o in offsets:
        if len(o):
            acc |= int(np.bitwise_or.reduce(o))
    return acc & -acc if acc else 1 << 20


def kernel_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    devices = {t.device for t in (src, dst) if t.device.type == "cuda"}
    if len(devices) > 1:
        raise ValueError(f"src and dst are on different GPUs: {src.device} and {dst.device}")
    if devices:
        return devices.pop()
    if not interpreting():
        raise RuntimeError(
            "copy_rows needs src or dst on a CUDA device (the other pinned on the host), "
            "or TRITON_INTERPRET=1 to run the kernel on CPU tensors"
        )
    return torch.device("cpu")


def to_kernel_device(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    if offsets.device == device:
        return offsets
    if device.type == "cuda" and offsets.device.type == "cpu":
        # Through pinned memory, so the upload does not block the host.
        staged = offsets if offsets.is_pinned() else offsets.pin_memory()
        return staged.to(device, non_blocking=True)
    raise ValueError(f"offsets on {offsets.device} cannot be used by a kernel on {device}")


def copy_rows(
    src: torch.Tensor,
    src_offsets: torch.Tensor,
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    row_words: int,
    *,
    sm_budget: int = 8,
    rows_per_program: int | None = None,
    validate: bool = True,
    offsets_align: int | None = None,
    stages: int | None = None,
) -> None:
    """Copy `n` rows of `row_words` words each from `src` to `dst` with a persistent Triton kernel.

    Row `i` copies `src[src_offsets[i] : src_offsets[i] + row_words]` to
    `dst[dst_offsets[i] : dst_offsets[i] + row_words]`.

    Args:
        src: `[src_numel]` words (int64, int32, int16 or uint8), 1-D and contiguous: the
            base of the source region; pinned CPU (gather) or CUDA (scatter).
        src_offsets: `[n]` int64, word offset of each source row from `src`'s start.
        dst: `[dst_numel]` words of `src`'s dtype, 1-D and contiguous; CUDA (gather) or
            pinned CPU (scatter).
        dst_offsets: `[n]` int64, word offset of each destination row from `dst`'s start.
        row_words: words per row, the same for every row (`>= 1`).
        sm_budget: number of programs of the persistent grid (at most; fewer when there
            are fewer row blocks).
        rows_per_program: rows each program has in flight per iteration (the tile;
            fewer when that many would exceed 16384 chunks); None (the default): by
            row size (`rows_in_flight`, ~64 KiB); 1 gives a one-row-at-a-time baseline.
        validate: check every row's bounds and that destination rows do not overlap,
            on the host, before launching. Needs CPU offsets; pass False when the
            offsets live on the GPU and were validated on the CPU beforehand.
        offsets_align: for offsets on the GPU, a number of words that divides every
            offset (e.g. the row size, for rows of an array): the kernel then uses the
            widest vectors that allows without checking them per tile. Offsets on the
            CPU are inspected instead.
        stages: tiles each program keeps in flight (its loop pipelined through shared
            memory); None: `MAX_STAGES`. At most what the device's shared memory holds
            (`stages_on`); 1 is no pipelining, as for scatters and rows that are not whole,
            aligned 128-byte lines (`pipelines`). Triton's interpreter runs tiles one by one.

    Raises:
        SlotError: offsets that are not `[n]` int64 of equal lengths, rows outside their
            tensor, overlapping (e.g. repeated) destination rows. Raised before launch.
        ValueError: `src`/`dst` of different or non-word dtypes, not 1-D contiguous, bad
            `row_words`/`sm_budget`/`rows_per_program`, rows wider than one tile (more
            than 16384 chunks: 256 KiB with 16-byte chunks), or `validate=True` with
            offsets on a CUDA device.
        RuntimeError: Triton is not installed, or neither CUDA nor its interpreter is on.
    """
    check_words(src, "src")
    check_words(dst, "dst")
    if src.dtype != dst.dtype:
        raise SlotError(f"src and dst must have the same words dtype, got {src.dtype} and {dst.dtype}")
    check_offsets(src_offsets, "src_offsets")
    check_offsets(dst_offsets, "dst_offsets")
    n = src_offsets.numel()
    if dst_offsets.numel() != n:
        raise SlotError(f"src_offsets has {n} rows but dst_offsets has {dst_offsets.numel()}")
    check_count("row_words", row_words)
    check_count("sm_budget", sm_budget)
    check_count("offsets_align", offsets_align, optional=True)
    check_count("rows_per_program", rows_per_program, optional=True)
    check_count("stages", stages, optional=True)
    if src_offsets.device != dst_offsets.device:
        raise ValueError(f"offsets on different devices: {src_offsets.device} and {dst_offsets.device}")

    offsets_on_host = src_offsets.device.type == "cpu"
    if validate:
        if not offsets_on_host:
            raise ValueError(
                "copy_rows(validate=True) needs the offsets on the CPU (it would otherwise wait for "
                f"the GPU); they are on {src_offsets.device}. Validate the CPU indices before "
                "uploading them and pass validate=False."
            )
        if n:
            validate_rows(src_offsets, row_words, src.numel(), "src_offsets")
            validate_rows(dst_offsets, row_words, dst.numel(), "dst_offsets")
            validate_disjoint(dst_offsets, row_words, "dst_offsets")
    if n == 0:
        return
    if triton is None:
        raise RuntimeError("copy_rows needs Triton, which is not installed (pip install 'kvtier[triton]')")
    device = kernel_device(src, dst)

    # Widest words the data allows: the row size, both base addresses, and (when they
    # can be read without waiting for the GPU) every offset must be multiples of it.
    size = _WORD_SIZES[src.dtype]
    if offsets_on_host:
        offset_bytes = common_alignment(src_offsets.numpy(), dst_offsets.numpy()) * size
    elif offsets_align is not None:
        offset_bytes = (offsets_align & -offsets_align) * size
    else:
        offset_bytes = None  # Unseen offsets: whole words of the given width, vectors checked per tile.
    known = None if offset_bytes is None else min(VECTOR_BYTES, offset_bytes)
    aligns = [src.data_ptr(), dst.data_ptr(), src.storage_offset() * size, dst.storage_offset() * size]
    width = word_size(row_words * size, [*aligns, known or size])
    src_w, dst_w = flat_words(src, width), flat_words(dst, width)
    row_w = row_words * size // width
    src_off = to_kernel_device(_rescale(src_offsets, size, width), device)
    dst_off = to_kernel_device(_rescale(dst_offsets, size, width), device)
    # Pipelined only for gathers of whole 128-byte lines at line-aligned addresses (`pipelines`);
    # unseen offsets are not. Under the interpreter, where both sides are on the CPU, as a gather.
    every = (offset_bytes or 0) | src.data_ptr() | dst.data_ptr()
    gather = src.device.type != "cuda"
    line = offset_bytes is not None and pipelines(
        row_words * size, every & -every if every else LINE_BYTES, gather
    )
    stages = (stages or MAX_STAGES) if line else 1

    if rows_per_program is None:
        rows_per_program = rows_in_flight(row_words * size, sm_budget, stages)
    # Tile: rows_per_program whole rows, one VEC-word chunk (at most 16 bytes) per lane.
    vec = 1
    while (
        vec * 2 * width <= VECTOR_BYTES
        and row_w % (vec * 2) == 0
        and (known is None or known % (vec * 2 * width) == 0)
    ):
        vec *= 2
    row_vecs = row_w // vec
    if row_vecs > MAX_TILE_CHUNKS:
        raise ValueError(
            f"rows of {row_w * width} bytes in {row_vecs} chunks of {vec * width} bytes are wider than one "
            f"tile of the kernel ({MAX_TILE_CHUNKS} chunks); split them into narrower rows"
        )
    # A tile holds at most MAX_TILE_CHUNKS lanes: fewer rows in flight than asked when wide.
    rows_per_program = min(rows_per_program, MAX_TILE_CHUNKS // row_vecs)
    block = next_power_of_2(rows_per_program * row_vecs)
    num_warps = warps_for(block * vec * width)
    # As many stages as the device's shared memory holds for this tile.
    stages = min(stages, _stages_fit(device, block * vec * width))

    num_blocks = -(-n // rows_per_program)
    grid = (min(sm_budget, num_blocks),)
    kernel = _kernel()
    launch_kwargs: dict[str, Any] = {
        "ROWS_PER_BLOCK": rows_per_program,
        "ROWS_POW": next_power_of_2(rows_per_program),
        "BLOCK": block,
        "VEC": vec,
        "CHECK_ALIGN": known is None,
        "STAGES": stages,
        "num_warps": num_warps,
        "num_stages": stages,
    }
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](src_w, src_off, dst_w, dst_off, n, row_vecs, **launch_kwargs)
    else:
        kernel[grid](src_w, src_off, dst_w, dst_off, n, row_vecs, **launch_kwargs)
