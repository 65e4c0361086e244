"""A Triton kernel that copies scattered KV rows between pinned host memory and the GPU (`copy_rows`).

`copy_rows` moves `n` rows of `row_words` words, each at its own word offset, from one 1-D
words tensor to another: a gather (load) reads pinned host memory and writes the GPU, a
scatter (backup) the reverse. The GPU reaches the pinned pages directly over PCIe, so
scattered rows need no staging buffer and no copy-engine call per run.

How: a row is `row_vecs` vectors of `VEC` words; a tile, `rows_per_program` whole rows as
their vectors in a block of `BLOCK` positions (a power of two, the rest masked off), is
loaded whole before any of it is stored. The grid is persistent: `min(sm_budget, tiles)`
programs loop over tiles `pid, pid + num_programs, ...`, so the copy holds `sm_budget` SMs
and no more. Gathers of whole 128-byte lines are pipelined over `STAGES` tiles in shared
memory, their offsets loaded once per row (`ROWS_POW`) and spread over its vectors.
`kvtier.transfer.launch` gives programs, rows and stages.

Contract:
- Row `i` copies `src[src_offsets[i] : src_offsets[i] + row_words]` to `dst[dst_offsets[i]
  : ...]`, bit for bit; `src`, `dst`: 1-D contiguous words of one dtype (`as_words`), the
  source rows not overlapping the destination rows (unchecked: different tiers).
- Offsets: `[n]` int64, on the GPU in real use (CPU offsets go up through pinned memory
  without blocking; under the interpreter everything is on the CPU). With `validate`, the
  host checks of `kernel_args` run first (callers with device offsets check their CPU
  indices and pass `validate=False`).
- Launched on the current stream; never waits for the GPU or reads a device value back.
- Words are re-viewed at the widest width (up to 8 bytes) dividing the row size, both base
  addresses and every CPU offset (device offsets are not read: never widened). Vectors are
  16 bytes where the offsets allow: known on the host (CPU offsets, `offsets_align`), else
  checked per tile on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtier.errors import TransferError
from kvtier.pool.rows import flat_words
from kvtier.transfer import kernel_args
from kvtier.transfer import launch as rules
from kvtier.transfer.kernel_args import (
    WORD_SIZES,
    ModeJit,
    check_count,
    check_offsets,
    check_words,
    common_alignment,
    host_offsets,
    kernel_device,
    launch_on,
    next_power_of_2,
    rescale,
    tl,
    to_kernel_device,
    validate_disjoint,
    validate_rows,
    word_size,
)


def runs_on(device: torch.device) -> bool:
    """Whether `copy_rows` can run with its device-side tensor on `device` here."""
    return kernel_args.triton is not None and (device.type == "cuda" or kernel_args.interpreting())


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
        elif not CHECK_ALIGN:
            # Offsets known to be multiples of VEC: no per-tile reduction making the warps wait.
            s_vec = tl.multiple_of(s + w, VEC)
            d_vec = tl.multiple_of(d + w, VEC)
            _copy_vectors_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
        else:
            # Offsets unseen on the host: their alignment is checked per tile (a reduction).
            misaligned = tl.max((s | d) & (VEC - 1), axis=0)
            if misaligned == 0:
                # Equal to s + w and d + w here; written so the compiler sees multiples of VEC.
                s_vec = tl.multiple_of((s // VEC) * VEC + w, VEC)
                d_vec = tl.multiple_of((d // VEC) * VEC + w, VEC)
                _copy_vectors_jit(src_ptr, dst_ptr, s_vec, d_vec, mask, VEC)
            else:
                _copy_vectors_jit(src_ptr, dst_ptr, s + w, d + w, mask, VEC)


# Bound by `_kernel` (`ModeJit`): the Triton-wrapped `_copy_vectors` that the kernel calls.
_copy_vectors_jit: Any = None
# n_rows changes with every call: one compiled kernel serves all of them.
_kernel = ModeJit(_copy_rows_kernel, _copy_vectors, do_not_specialize=["n_rows"])


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

    `src`: `[src_numel]` words, pinned CPU (gather) or CUDA (scatter); `dst`: `[dst_numel]`
    words of `src`'s dtype on the other side; `src_offsets`, `dst_offsets`: `[n]` int64.
    `sm_budget`: programs (at most); `rows_per_program`: rows per tile (at most
    `launch.MAX_TILE_VECTORS` vectors; None: `launch.rows_in_flight`); `offsets_align`: words
    dividing every device offset; `stages`: tiles in flight (None: `launch.MAX_STAGES`), as
    far as shared memory holds them, where `launch.pipelines`. Raises before launch.
    """
    check_words(src, "src")
    check_words(dst, "dst")
    if src.dtype != dst.dtype:
        raise TransferError(f"src and dst must have the same words dtype, got {src.dtype} and {dst.dtype}")
    n = check_offsets(src_offsets, dst_offsets, ("src_offsets", "dst_offsets"), "rows")
    check_count("row_words", row_words)
    check_count("sm_budget", sm_budget)
    optional = {"offsets_align": offsets_align, "rows_per_program": rows_per_program, "stages": stages}
    for name, value in optional.items():
        check_count(name, value, optional=True)
    on_host = host_offsets(validate, src_offsets, "copy_rows")
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
    width, row_vecs, rows, kwargs = shape
    src_off = to_kernel_device(rescale(src_offsets, size, width), device)
    dst_off = to_kernel_device(rescale(dst_offsets, size, width), device)
    args = (flat_words(src, width), src_off, flat_words(dst, width), dst_off, n, row_vecs)
    launch_on(device, _kernel(), min(sm_budget, -(-n // rows)), args, kwargs)


def _row_shape(
    src: torch.Tensor,
    dst: torch.Tensor,
    row_bytes: int,
    offset_bytes: int | None,
    device: torch.device,
    sm_budget: int,
    rows_per_program: int | None,
    stages: int | None,
) -> tuple[int, int, int, dict[str, Any]]:
    """Word bytes, vectors per row, rows per tile and the kernel's keyword arguments for rows of
    `row_bytes` at offsets that are multiples of `offset_bytes` (None: unseen)."""
    size = WORD_SIZES[src.dtype]
    # Widest words the row size, both base addresses and every offset seen are multiples of.
    known = None if offset_bytes is None else min(rules.VECTOR_BYTES, offset_bytes)
    aligns = [src.data_ptr(), dst.data_ptr(), src.storage_offset() * size, dst.storage_offset() * size]
    width = word_size(row_bytes, [*aligns, known or size])
    row_w = row_bytes // width
    # Unseen offsets are not pipelined. Under the interpreter (both sides on the CPU), as a gather.
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
    rows = min(rows_per_program, rules.MAX_TILE_VECTORS // row_vecs)
    block = next_power_of_2(rows * row_vecs)
    tile = block * vec * width
    stages = min(stages, rules.stages_fit(rules.shared_bytes(device), tile))
    kwargs = {
        "ROWS_PER_BLOCK": rows,
        "ROWS_POW": next_power_of_2(rows),
        "BLOCK": block,
        "VEC": vec,
        "CHECK_ALIGN": known is None,
        "STAGES": stages,
        "num_warps": rules.warps_for(tile),
        "num_stages": stages,
    }
    return width, row_vecs, rows, kwargs
