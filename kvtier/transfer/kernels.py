"""A Triton kernel that copies scattered KV rows between pinned host memory and the GPU (`copy_rows`).

`copy_rows` moves `n` rows of `row_words` words, each at its own word offset, from one 1-D words
tensor to another: a gather (load) reads pinned host memory over PCIe, a scatter (backup) writes
it. A tile of `rows_per_program` whole rows is loaded whole before any of it is stored; the grid
is persistent (`min(sm_budget, tiles)` programs loop over tiles), so the copy holds `sm_budget`
SMs and no more; gathers of whole 128-byte lines are pipelined over `STAGES` tiles in shared
memory. `kvtier.transfer.launch` gives programs, rows and stages; `RowLaunch` is one launch shaped
once (`prepare_rows`) and run per layer.

Contract: row `i` copies `src[src_offsets[i] : + row_words]` to `dst[dst_offsets[i] : ...]` bit for
bit, the source rows not overlapping the destination rows; offsets are `[n]` int64 on the GPU in
real use (with `validate`, the host checks of `kernel_args` run first, on CPU offsets); launched on
the current stream, it never waits for the GPU. Words are re-viewed at the widest width (up to 8
bytes) the row size, base addresses and CPU offsets allow; vectors are 16 bytes where the offsets
allow, checked per tile on the GPU where the host has not seen them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
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


def row_kernel() -> Any:
    """The Triton kernel `copy_rows` launches (jitted for the current mode)."""
    return _kernel()


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
    bases = [src.data_ptr(), dst.data_ptr()]
    # The views' storage offsets bound the word width (`flat_words`), not the addresses' alignment.
    views = (src.storage_offset() * size, dst.storage_offset() * size)
    gather = src.device.type != "cuda"
    where = (row_words * size, size, bases, offset_bytes, gather, device)
    shape = RowShape.of(*where, sm_budget, rows_per_program, stages, views)
    src_off = to_kernel_device(rescale(src_offsets, size, shape.word), device)
    dst_off = to_kernel_device(rescale(dst_offsets, size, shape.word), device)
    args = (flat_words(src, shape.word), src_off, flat_words(dst, shape.word), dst_off, n, shape.row_vecs)
    launch_on(device, _kernel(), shape.grid(n), args, shape.kwargs)


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
        offset_bytes: int | None,
        gather: bool,
        device: torch.device,
        sm_budget: int,
        rows_per_program: int | None,
        stages: int | None,
        views: tuple[int, ...] = (),
    ) -> RowShape:
        """The shape for rows of `row_bytes` in words of at most `size` bytes, between base addresses
        whose alignments are `bases`, at offsets that are multiples of `offset_bytes` (None: unseen);
        `gather`: the rows are read from the host; `views`: byte offsets the words must also divide
        (tensors' storage offsets), not addresses."""
        # Widest words the row size, both base addresses and every offset seen are multiples of.
        known = None if offset_bytes is None else min(rules.VECTOR_BYTES, offset_bytes)
        width = word_size(row_bytes, [*bases, *views, known or size])
        row_w = row_bytes // width
        every = offset_bytes or 0
        for a in bases:
            every |= a
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
