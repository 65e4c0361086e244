"""A Triton kernel that moves several layers of each KV unit in one pass, when the host keeps them together.

What this module owns
---------------------
In the `page_first` host layout a page holds `[layers, page_size, *row]`, so the rows
of one page on consecutive layers are adjacent on the host; on the GPU each layer is
its own tensor. `copy_groups` moves `G` consecutive layers of `n` units (a unit: one
page's rows of one layer, `unit_words` words) in one launch:

- packed side (host): unit `i`'s `G` layers are the `G * unit_words` words (its
  "stretch") from `packed_shift + packed_offsets[i]` in `packed`;
- split side (GPU): layer `j` of unit `i` is the `unit_words` words from
  `split_offsets[i]` in `layers[j]`.

It serves both directions: gather (load) reads the packed side and writes the split
side, scatter (backup) the reverse.

Why
---
A gather of scattered small rows is bound by the number of PCIe read requests, not by
bytes: a 132-byte DSA indexer row needs two whatever its alignment, and one layer's
scattered indexer rows move at 0.46-0.58 of the link's ceiling on an H200. A stretch
of 16 layers of one token is 2112 contiguous bytes: read in 16-byte lanes by this
kernel, stretches of 16 to 78 layers move at 0.80-0.83 of the ceiling (loads) and
0.78-0.84 (backups) on 8 SMs, and 656-byte fp8 MLA rows at 0.92-0.93 from 8 layers
against 0.85 one layer at a time (bench/NOTES.md, sixth session).

How
---
Each lane moves one 16-byte chunk of a stretch, aligned to 16 bytes in memory. A
stretch need not be aligned (61 layers of 132 bytes are 8052 bytes): its lanes cover
the aligned chunks that overlap it; chunks wholly inside move as one vector, the two
edge chunks word by word, masked to the stretch; the split side is written (or read)
word by word, each word to its layer's row. When every stretch and every split row
is aligned and a unit is a whole number of chunks (656- and 1152-byte rows), both
sides move in vectors. The grid is persistent, `sm_budget` programs with ~80 KiB of
stretches in flight each (`GROUP_TILE_BYTES`; 128 KiB tiles were slower: 0.51-0.65 of the
ceiling).

Contract: as `kernels.copy_rows` (same word dtypes, launched on the current stream,
never waits for the GPU, `validate=True` checks every bound and overlap on the host
before launching).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import SlotError
from kvtier.pool.device import Direction
from kvtier.transfer import kernels
from kvtier.transfer.kernels import tl, triton

__all__ = ["GROUP_TILE_BYTES", "copy_groups", "units_in_flight"]

# Bytes of stretches in flight per program by default. For 132-byte rows on an H200 (8
# programs), loads reached 0.80-0.83 of the ceiling with ~80 KiB at 8, 16, 32 and 78 layers
# per stretch, but 0.67-0.76 with 64 KiB at 8, 16 and 32 layers (bench/NOTES.md, sixth session).
GROUP_TILE_BYTES = 80 * 1024


def units_in_flight(stretch_bytes: int) -> int:
    """Units per program: as many whole stretches as fit in `GROUP_TILE_BYTES` (at least one)."""
    return max(1, GROUP_TILE_BYTES // stretch_bytes)


def _copy_groups_kernel(
    packed_ptr,
    packed_off_ptr,
    split_ptr,
    split_off_ptr,
    layer_off_ptr,
    layer_first,
    layer_stride,
    packed_shift,
    n_units,
    UNIT_WORDS: tl.constexpr,
    LAYERS: tl.constexpr,
    UNITS_PER_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    STRIDED: tl.constexpr,
    LOAD: tl.constexpr,
):
    """Persistent grid over blocks of `UNITS_PER_BLOCK` units, `CHUNKS` lanes of `VEC` words per unit.

    Layer `j`'s tensor starts `layer_first + j * layer_stride` words from `split_ptr` when
    `STRIDED` (layers of one allocation, as `DevicePool` makes them), else
    `layer_off_ptr[j]` words (any sign): a table read per word, which costs the gather
    time (16 layers of 132-byte rows on an H200: 0.67 of the ceiling, 0.79-0.83 strided).
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    span = LAYERS * UNIT_WORDS
    lane = tl.arange(0, BLOCK)
    k = tl.arange(0, VEC)
    in_block = lane < UNITS_PER_BLOCK * CHUNKS
    for block in range(pid, tl.cdiv(n_units, UNITS_PER_BLOCK), num_programs):
        unit = block * UNITS_PER_BLOCK + lane // CHUNKS
        live = in_block & (unit < n_units)
        c = lane % CHUNKS
        p = tl.load(packed_off_ptr + unit, mask=live, other=0) + packed_shift
        s = tl.load(split_off_ptr + unit, mask=live, other=0)
        if ALIGNED:
            # The chunk lies in one layer's row, aligned on both sides.
            w = c * VEC
            if STRIDED:
                lo = layer_first + (w // UNIT_WORDS) * layer_stride
            else:
                lo = tl.load(layer_off_ptr + w // UNIT_WORDS, mask=live, other=0)
            pa = packed_ptr + (tl.multiple_of(p + w, VEC)[:, None] + k[None, :])
            sa = split_ptr + (tl.multiple_of(s + lo + w % UNIT_WORDS, VEC)[:, None] + k[None, :])
            m = live[:, None]
            if LOAD:
                tl.store(sa, tl.load(pa, mask=m), mask=m)
            else:
                tl.store(pa, tl.load(sa, mask=m), mask=m)
        else:
            head = p % VEC  # words of the first aligned chunk before the stretch starts
            start = c * VEC - head  # stretch word where this lane's chunk starts
            r = start[:, None] + k[None, :]
            inside = live[:, None] & (r >= 0) & (r < span)
            whole = tl.broadcast_to((live & (start >= 0) & (start + VEC <= span))[:, None], (BLOCK, VEC))
            edge = inside & ~whole
            r = tl.where(inside, r, 0)
            if STRIDED:
                lo = layer_first + (r // UNIT_WORDS) * layer_stride
            else:
                lo = tl.load(layer_off_ptr + r // UNIT_WORDS, mask=inside, other=0)
            sa = split_ptr + (s[:, None] + lo + r % UNIT_WORDS)
            pa = packed_ptr + (tl.multiple_of(p - head + c * VEC, VEC)[:, None] + k[None, :])
            if LOAD:
                # Whole chunks as vectors (the mask is the same along a chunk), edges word by word.
                vals = tl.where(whole, tl.load(pa, mask=whole), tl.load(pa, mask=edge))
                tl.store(sa, vals, mask=inside)
            else:
                vals = tl.load(sa, mask=inside)
                tl.store(pa, vals, mask=whole)
                tl.store(pa, vals, mask=edge)


# The Triton kernel for the current mode (compiled, or Triton's CPU interpreter).
_kernel = kernels.ModeJit(
    _copy_groups_kernel, do_not_specialize=["n_units", "packed_shift", "layer_first", "layer_stride"]
)


def layer_offsets(layers: Sequence[torch.Tensor]) -> list[int]:
    """Word offset of each of `layers` (1-D words tensors of one dtype) from the first one's start (any sign).

    Raises:
        SlotError: a layer whose address is not a whole number of words from the first.
    """
    size = layers[0].element_size()
    base = layers[0].data_ptr()
    out = []
    for j, t in enumerate(layers):
        delta = t.data_ptr() - base
        if delta % size:
            raise SlotError(f"layer {j} starts {delta} bytes from the first, not whole {size}-byte words")
        out.append(delta // size)
    return out


def copy_groups(
    packed: torch.Tensor,
    packed_offsets: torch.Tensor,
    layers: Sequence[torch.Tensor],
    split_offsets: torch.Tensor,
    unit_words: int,
    direction: Direction,
    *,
    packed_shift: int = 0,
    table: tuple[torch.Tensor, torch.Tensor] | None = None,
    sm_budget: int = 8,
    units_per_program: int | None = None,
    validate: bool = True,
    offsets_align: int | None = None,
) -> None:
    """Move `len(layers)` layers of `n` units between packed stretches and per-layer rows.

    Args:
        packed: `[packed_numel]` words (int64, int32, int16 or uint8), 1-D contiguous:
            pinned CPU memory (the host side).
        packed_offsets: `[n]` int64, word offset of each unit's stretch (its first layer)
            from `packed`'s start, before `packed_shift` is added.
        layers: `G` tensors `[layer_numel]` of `packed`'s dtype, 1-D contiguous, on one
            CUDA device (or the CPU under Triton's interpreter): the split side, layer
            by layer. Their addresses must be whole words apart.
        split_offsets: `[n]` int64, word offset of each unit's row in every layer tensor.
        unit_words: words per unit and layer (`>= 1`).
        direction: `LOAD` copies packed -> layers, `BACKUP` layers -> packed.
        packed_shift: words added to every packed offset (the group's first layer within
            a page), so one offsets tensor serves every group of layers.
        table: `(base, offsets)`: a words tensor `base` and `[G]` int64 on the kernel's
            device, each layer's word offset from `base`'s start (what
            `layer_offsets([base, *layers])[1:]` gives), uploaded once by the caller;
            None: `base` is `layers[0]` and the offsets are uploaded here (a small
            non-blocking copy).
        sm_budget: programs of the persistent grid (at most).
        units_per_program: units in flight per program; None: `units_in_flight`.
        validate: check bounds and overlaps on the host first (needs CPU offsets).
        offsets_align: for offsets on the GPU, a number of words dividing every packed
            and split offset; with it the kernel may use vectors on the split side.

    Raises:
        SlotError: bad offsets (not `[n]` int64, out of bounds, overlapping destinations)
            or layers not whole words apart; raised before launch.
        ValueError: mismatched dtypes or devices, bad sizes, a stretch wider than one
            tile, `validate=True` with offsets on the GPU.
        RuntimeError: no Triton, or neither CUDA nor its interpreter.
    """
    if not layers:
        raise ValueError("copy_groups needs at least one layer")
    kernels.check_words(packed, "packed")
    for j, t in enumerate(layers):
        kernels.check_words(t, f"layers[{j}]")
        if t.dtype != packed.dtype or t.device != layers[0].device:
            raise SlotError(
                f"layers[{j}] is {t.dtype} on {t.device}; expected {packed.dtype} on {layers[0].device}"
            )
    kernels.check_offsets(packed_offsets, "packed_offsets")
    kernels.check_offsets(split_offsets, "split_offsets")
    n = packed_offsets.numel()
    if split_offsets.numel() != n:
        raise SlotError(f"packed_offsets has {n} units but split_offsets has {split_offsets.numel()}")
    if split_offsets.device != packed_offsets.device:
        raise ValueError(f"offsets on different devices: {packed_offsets.device} and {split_offsets.device}")
    kernels.check_count("unit_words", unit_words)
    kernels.check_count("sm_budget", sm_budget)
    kernels.check_count("packed_shift", packed_shift, least=0)
    kernels.check_count("units_per_program", units_per_program, optional=True)
    base = layers[0] if table is None else table[0]
    deltas = layer_offsets([base, *layers])[1:]
    g = len(layers)
    size = packed.element_size()
    offsets_on_host = packed_offsets.device.type == "cpu"
    if validate:
        if not offsets_on_host:
            raise ValueError(
                "copy_groups(validate=True) needs the offsets on the CPU; validate them there and pass "
                "validate=False"
            )
        if n:
            span = g * unit_words
            kernels.validate_rows(packed_offsets + packed_shift, span, packed.numel(), "packed_offsets")
            for j, t in enumerate(layers):
                kernels.validate_rows(split_offsets, unit_words, t.numel(), f"split_offsets (layer {j})")
            if direction is Direction.LOAD:
                kernels.validate_disjoint(split_offsets, unit_words, "split_offsets")
            else:
                kernels.validate_disjoint(packed_offsets, span, "packed_offsets")
    if n == 0:
        return
    if triton is None:
        raise RuntimeError("copy_groups needs Triton, which is not installed (pip install 'kvtier[triton]')")
    device = kernels.kernel_device(packed, layers[0])

    vec = max(1, kernels.VECTOR_BYTES // size)
    if packed.data_ptr() % kernels.VECTOR_BYTES:
        vec = 1  # the packed side's chunks could not be aligned: word by word
    if offsets_on_host:
        known = kernels.common_alignment(packed_offsets.numpy(), split_offsets.numpy())
    else:
        known = offsets_align or 1
    aligned = (
        vec > 1
        and unit_words % vec == 0
        and (known | packed_shift) % vec == 0
        and all(d % vec == 0 for d in deltas)
        and base.data_ptr() % kernels.VECTOR_BYTES == 0
    )
    span = g * unit_words
    chunks = span // vec if aligned else (span + 2 * vec - 2) // vec
    if chunks > kernels.MAX_TILE_CHUNKS:
        raise ValueError(
            f"a stretch of {g} layers x {unit_words * size} bytes is wider than one tile of the kernel "
            f"({kernels.MAX_TILE_CHUNKS} chunks of {vec * size} bytes); move fewer layers at once"
        )
    if units_per_program is None:
        units_per_program = units_in_flight(span * size)
    units_per_program = min(units_per_program, kernels.MAX_TILE_CHUNKS // chunks)
    block = kernels.next_power_of_2(units_per_program * chunks)
    if table is not None and (table[1].numel() != g or table[1].device != device):
        got = f"{tuple(table[1].shape)} on {table[1].device}"
        raise SlotError(f"table: [{g}] offsets on {device} expected, got {got}")
    # Layers evenly spaced (one allocation): a stride, no table.
    stride = deltas[1] - deltas[0] if g > 1 else 0
    strided = all(d == deltas[0] + j * stride for j, d in enumerate(deltas))
    if strided:
        offsets = None
    elif table is None:
        offsets = kernels.to_kernel_device(torch.tensor(deltas, dtype=torch.int64), device)
    else:
        offsets = table[1]
    packed_off = kernels.to_kernel_device(packed_offsets, device)
    split_off = kernels.to_kernel_device(split_offsets, device)
    grid = (min(sm_budget, -(-n // units_per_program)),)
    launch: dict[str, Any] = {
        "UNIT_WORDS": unit_words,
        "LAYERS": g,
        "UNITS_PER_BLOCK": units_per_program,
        "CHUNKS": chunks,
        "BLOCK": block,
        "VEC": vec,
        "ALIGNED": aligned,
        "STRIDED": strided,
        "LOAD": direction is Direction.LOAD,
        "num_warps": kernels.warps_for(block * vec * size),
    }
    # Strided: the table argument is never read; any int64 tensor stands in for it.
    table_arg = split_off if offsets is None else offsets
    args = (packed, packed_off, base, split_off, table_arg, deltas[0], stride, packed_shift, n)
    if device.type == "cuda":
        with torch.cuda.device(device):
            _kernel()[grid](*args, **launch)
    else:
        _kernel()[grid](*args, **launch)
