"""A Triton kernel that copies scattered KV rows between pinned host memory and the GPU.

What this module owns
---------------------
`copy_rows` moves `n` equally sized rows, each at its own word offset, from one 1-D
words tensor to another. The same kernel serves both directions:

- gather (load), host -> device: `src` is pinned CPU memory, `dst` is on the GPU;
- scatter (backup), device -> host: `src` is on the GPU, `dst` is pinned CPU memory.

The GPU reads or writes the pinned host pages directly over PCIe (a pinned tensor's
pointer is valid on the GPU through unified virtual addressing), so no staging
buffer and no copy-engine call per run is needed. This is the path for scattered
rows (short runs), where the copy engine pays a fixed cost per run.

How it moves rows
-----------------
A row is `row_vecs` vectors of `VEC` words (a vector: up to 16 bytes, the widest access
one thread makes). A tile is `rows_per_program` whole rows flattened into their vectors
back to back, one per position of a block of `BLOCK` (the vectors rounded up to a power
of two, the positions past them masked off), so its bytes in flight are the rows'
bytes whatever the row size. Each program loads a whole tile before it stores any of
it. The grid is persistent and small: exactly `min(sm_budget, tiles)` programs, each
looping over tiles `pid, pid + num_programs, ...`, so the copy takes `sm_budget` SMs
from the model running beside it, and no more. A gather of rows that are whole
128-byte lines is pipelined over `STAGES` tiles: while one tile is stored, the loads of
the next ones go out as asynchronous copies into shared memory (which hold no
registers); the rows' offsets are then loaded once per row (`ROWS_POW` of them) and
spread over their vectors in registers, so only the rows' bytes wait in shared memory.
How many programs, rows and stages a launch takes is `kvtier.transfer.launch`'s rule.

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
  kernel then uses 16-byte vectors where the offsets allow: known on the host (CPU
  offsets, or `offsets_align`), or else checked on the GPU per tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import TransferError
from kvtier.pool.rows import flat_words
from kvtier.transfer import jit
from kvtier.transfer import launch as rules
from kvtier.transfer.jit import ModeJit, tl
from kvtier.transfer.kernel_args import (
    WORD_SIZES,
    check_count,
    check_offsets,
    check_pair,
    check_words,
    common_alignment,
    host_offsets,
    kernel_device,
    launch_on,
    next_power_of_2,
    rescale,
    to_kernel_device,
    validate_disjoint,
    validate_rows,
    word_size,
)


def runs_on(device: torch.device) -> bool:
    """Whether `copy_rows` can run with its device-side tensor on `device` here."""
    return jit.triton is not None and (device.type == "cuda" or jit.interpreting())


def triton_available() -> bool:
    """Whether `copy_rows` can run here: Triton imports, and CUDA or Triton's CPU interpreter is on."""
    return jit.triton is not None and (torch.cuda.is_available() or jit.interpreting())


# ---------------------------------------------------------------------------
# The kernel. Its bodies are plain functions, turned into Triton kernels on first
# use (`_kernel`), so that whether they run compiled or under the interpreter is
# decided by TRITON_INTERPRET at that time, not when this module was imported.
# ---------------------------------------------------------------------------


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
    CHECK_ALIGN: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Persistent grid: program `pid` copies tiles `pid, pid + num_programs, ...` (see the module
    docstring: tiles, vectors, stages)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(n_rows, ROWS_PER_BLOCK)
    vector = tl.arange(0, BLOCK)
    in_block = vector < ROWS_PER_BLOCK * row_vecs
    for block in tl.range(pid, num_blocks, num_programs, num_stages=STAGES):
        # Row of each vector, and word offset of the vector within the row (a multiple of VEC):
        # computed per tile, as holding them across tiles costs registers.
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
        elif not CHECK_ALIGN:
            # Every offset is a multiple of VEC (known on the host): no check, and no
            # reduction that makes the warps of a program wait for each other per tile.
            s_vec = tl.multiple_of(s + w, VEC)
            d_vec = tl.multiple_of(d + w, VEC)
            _copy_vectors_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
        else:
            # The offsets are not known on the host (they live on the GPU and no alignment
            # was promised), so the alignment for VEC-word vectors is checked per tile: a
            # reduction over the tile, after which its warps wait for each other.
            misaligned = tl.max((s | d) & (VEC - 1), axis=0)
            if misaligned == 0:
                # Equal to s + w and d + w here; written so the compiler sees multiples of VEC.
                s_vec = tl.multiple_of((s // VEC) * VEC + w, VEC)
                d_vec = tl.multiple_of((d // VEC) * VEC + w, VEC)
                _copy_vectors_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
            else:
                _copy_vectors_jit(src_ptr, dst_ptr, s + w, d + w, mask, VEC)


# The Triton-wrapped `_copy_vectors`, which `_copy_rows_kernel` calls by this name (set by `_kernel`).
_copy_vectors_jit: Any = None
_vectors = ModeJit(_copy_vectors)
# n_rows changes with every call: one compiled kernel serves all of them.
_rows = ModeJit(_copy_rows_kernel, do_not_specialize=["n_rows"])


def _kernel() -> Any:
    """The Triton kernel for the current mode (compiled, or Triton's CPU interpreter)."""
    global _copy_vectors_jit
    _copy_vectors_jit = _vectors()
    return _rows()


# ---------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------


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

    `src`: `[src_numel]` words, 1-D contiguous, the base of the source rows: pinned CPU
    (gather) or CUDA (scatter); `dst`: `[dst_numel]` words of `src`'s dtype, CUDA (gather)
    or pinned CPU (scatter). `src_offsets`, `dst_offsets`: `[n]` int64, each row's word
    offset from its tensor's start. `row_words`: words per row (`>= 1`). `sm_budget`:
    programs of the persistent grid (at most). `rows_per_program`: rows per tile (fewer
    when that many would exceed `launch.MAX_TILE_VECTORS` vectors); None: by row size
    (`launch.rows_in_flight`). `validate`: check every row's bounds and that destination
    rows do not overlap, on the host, before launching (needs CPU offsets).
    `offsets_align`: for offsets on the GPU, a number of words dividing every offset: the
    kernel then uses the widest vectors that allows without checking them per tile.
    `stages`: tiles each program keeps in flight (None: `launch.MAX_STAGES`), at most what
    the device's shared memory holds; 1 for scatters and rows that are not whole, aligned
    128-byte lines (`launch.pipelines`).

    Raises (before launch): `TransferError` for bad tensors or offsets (dtypes, shapes,
    lengths, rows outside their tensor, overlapping destination rows, rows wider than one
    tile, `validate=True` with offsets on a GPU); `ConfigError` for bad counts;
    `BackendUnavailableError` without Triton, or without CUDA and its interpreter.
    """
    _check_call(
        src, src_offsets, dst, dst_offsets, row_words, sm_budget, rows_per_program, offsets_align, stages
    )
    on_host = host_offsets(validate, src_offsets, "copy_rows")
    n = src_offsets.numel()
    if validate and n:
        validate_rows(src_offsets, row_words, src.numel(), "src_offsets")
        validate_rows(dst_offsets, row_words, dst.numel(), "dst_offsets")
        validate_disjoint(dst_offsets, row_words, "dst_offsets")
    if n == 0:
        return
    device = kernel_device(src, dst, "copy_rows")
    size = WORD_SIZES[src.dtype]
    if on_host:
        offset_bytes = common_alignment(src_offsets.numpy(), dst_offsets.numpy()) * size
    elif offsets_align is not None:
        offset_bytes = (offsets_align & -offsets_align) * size
    else:
        offset_bytes = None  # Unseen offsets: whole words of the given width, vectors checked per tile.
    shape = _row_shape(src, dst, row_words * size, offset_bytes, device, sm_budget, rows_per_program, stages)
    src_off = to_kernel_device(rescale(src_offsets, size, shape.width), device)
    dst_off = to_kernel_device(rescale(dst_offsets, size, shape.width), device)
    args = (flat_words(src, shape.width), src_off, flat_words(dst, shape.width), dst_off, n, shape.row_vecs)
    grid = (min(sm_budget, -(-n // shape.rows)),)
    launch_on(device, _kernel(), grid, args, shape.kwargs())


def _check_call(
    src: torch.Tensor,
    src_offsets: torch.Tensor,
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    row_words: int,
    sm_budget: int,
    rows_per_program: int | None,
    offsets_align: int | None,
    stages: int | None,
) -> None:
    """The metadata checks of `copy_rows` (dtypes, shapes, lengths, counts, devices)."""
    check_words(src, "src")
    check_words(dst, "dst")
    if src.dtype != dst.dtype:
        raise TransferError(f"src and dst must have the same words dtype, got {src.dtype} and {dst.dtype}")
    check_offsets(src_offsets, "src_offsets")
    check_offsets(dst_offsets, "dst_offsets")
    check_pair(src_offsets, dst_offsets, ("src_offsets", "dst_offsets"), "rows")
    check_count("row_words", row_words)
    check_count("sm_budget", sm_budget)
    check_count("offsets_align", offsets_align, optional=True)
    check_count("rows_per_program", rows_per_program, optional=True)
    check_count("stages", stages, optional=True)


@dataclass(frozen=True)
class _RowShape:
    """How one `copy_rows` call is launched: words of `width` bytes, `row_vecs` vectors of `vec` words
    per row, `rows` rows per tile in a block of `block` positions, `warps`, `stages`; `check_align`
    where the offsets' alignment is checked per tile on the GPU."""

    width: int
    vec: int
    row_vecs: int
    rows: int
    block: int
    warps: int
    stages: int
    check_align: bool

    def kwargs(self) -> dict[str, Any]:
        return {
            "ROWS_PER_BLOCK": self.rows,
            "ROWS_POW": next_power_of_2(self.rows),
            "BLOCK": self.block,
            "VEC": self.vec,
            "CHECK_ALIGN": self.check_align,
            "STAGES": self.stages,
            "num_warps": self.warps,
            "num_stages": self.stages,
        }


def _row_shape(
    src: torch.Tensor,
    dst: torch.Tensor,
    row_bytes: int,
    offset_bytes: int | None,
    device: torch.device,
    sm_budget: int,
    rows_per_program: int | None,
    stages: int | None,
) -> _RowShape:
    """The launch shape of rows of `row_bytes` at offsets that are multiples of `offset_bytes` (None:
    unseen), from `src` to `dst`."""
    size = WORD_SIZES[src.dtype]
    # Widest words the data allows: the row size, both base addresses, and (when they
    # can be read without waiting for the GPU) every offset must be multiples of it.
    known = None if offset_bytes is None else min(rules.VECTOR_BYTES, offset_bytes)
    aligns = [src.data_ptr(), dst.data_ptr(), src.storage_offset() * size, dst.storage_offset() * size]
    width = word_size(row_bytes, [*aligns, known or size])
    row_w = row_bytes // width
    # Pipelined only for gathers of whole 128-byte lines at line-aligned addresses (`pipelines`);
    # unseen offsets are not. Under the interpreter, where both sides are on the CPU, as a gather.
    every = (offset_bytes or 0) | src.data_ptr() | dst.data_ptr()
    gather = src.device.type != "cuda"
    line = offset_bytes is not None and rules.pipelines(
        row_bytes, every & -every if every else rules.LINE_BYTES, gather
    )
    stages = (stages or rules.MAX_STAGES) if line else 1
    if rows_per_program is None:
        rows_per_program = rules.rows_in_flight(row_bytes, sm_budget, stages)
    vec = 1
    while (
        vec * 2 * width <= rules.VECTOR_BYTES
        and row_w % (vec * 2) == 0
        and (known is None or known % (vec * 2 * width) == 0)
    ):
        vec *= 2
    row_vecs = row_w // vec
    if row_vecs > rules.MAX_TILE_VECTORS:
        raise TransferError(
            f"rows of {row_bytes} bytes in {row_vecs} vectors of {vec * width} bytes are wider than one "
            f"tile of the kernel ({rules.MAX_TILE_VECTORS} vectors); split them into narrower rows"
        )
    # A tile holds at most MAX_TILE_VECTORS vectors: fewer rows in flight than asked when wide.
    rows = min(rows_per_program, rules.MAX_TILE_VECTORS // row_vecs)
    block = next_power_of_2(rows * row_vecs)
    tile = block * vec * width
    # As many stages as the device's shared memory holds for this tile.
    stages = min(stages, rules.stages_fit(rules.shared_bytes(device), tile))
    return _RowShape(width, vec, row_vecs, rows, block, rules.warps_for(tile), stages, known is None)
