"""A Triton kernel that moves several layers of each KV unit in one pass, when the host keeps them together.

In `page_first` a page holds `[layers, page_size, *row]`: its rows on consecutive layers are
adjacent on the host, while on the GPU each layer is its own tensor. `copy_groups` moves a
group of `G` consecutive layers of `n` units (a unit: one page's rows of one layer,
`unit_words` words) in one launch, a gather (load) from the packed side to the split side,
a scatter (backup) the reverse:

- packed side (host): unit `i`'s stack (its rows of the `G` layers) is the `G * unit_words`
  words from `packed_shift + packed_offsets[i]` in `packed`;
- split side (GPU): layer `j` of unit `i` is the `unit_words` words from `split_offsets[i]`
  in `layers[j]`.

A gather of small scattered rows is bound by PCIe read requests, not bytes, and a stack
is one long read (bench/FINDINGS.md). Each position of a tile moves one 16-byte vector of
a stack, aligned in memory; a stack need not be: vectors wholly inside it move at once,
the two edge vectors word by word (masked to the stack), and the split side word by word.
Where every stack and split row is aligned and a unit is whole vectors, both sides move in
vectors. Layers of one allocation are found by a stride, others through a table read per
word. The grid is persistent: `sm_budget` programs, `GROUP_TILE_BYTES` of stacks each.
Contract: as `kernels.copy_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.errors import TransferError
from kvtier.pool.device import Direction
from kvtier.transfer import launch as rules
from kvtier.transfer.kernel_args import (
    ModeJit,
    check_count,
    check_offsets,
    check_words,
    common_alignment,
    host_offsets,
    kernel_device,
    launch_on,
    next_power_of_2,
    tl,
    to_kernel_device,
    validate_disjoint,
    validate_rows,
)

# Bytes of stacks in flight per program by default (bench/FINDINGS.md).
GROUP_TILE_BYTES = 80 * 1024


def units_in_flight(stack_bytes: int) -> int:
    """Units per program: as many whole stacks as fit in `GROUP_TILE_BYTES` (at least one)."""
    return max(1, GROUP_TILE_BYTES // stack_bytes)


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
    VECTORS: tl.constexpr,
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    STRIDED: tl.constexpr,
    LOAD: tl.constexpr,
):
    """Persistent grid over tiles of `UNITS_PER_BLOCK` units, `VECTORS` vectors of `VEC` words per
    unit's stack (see the module docstring)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    vector = tl.arange(0, BLOCK)
    k = tl.arange(0, VEC)
    in_block = vector < UNITS_PER_BLOCK * VECTORS
    for block in range(pid, tl.cdiv(n_units, UNITS_PER_BLOCK), num_programs):
        unit = block * UNITS_PER_BLOCK + vector // VECTORS
        live = in_block & (unit < n_units)
        c = vector % VECTORS
        p = tl.load(packed_off_ptr + unit, mask=live, other=0) + packed_shift
        s = tl.load(split_off_ptr + unit, mask=live, other=0)
        if ALIGNED:
            # The vector lies in one layer's row, aligned on both sides.
            w = c * VEC
            lo = _layer_start_jit(layer_off_ptr, layer_first, layer_stride, w // UNIT_WORDS, live, STRIDED)
            pa = packed_ptr + (tl.multiple_of(p + w, VEC)[:, None] + k[None, :])
            sa = split_ptr + (tl.multiple_of(s + lo + w % UNIT_WORDS, VEC)[:, None] + k[None, :])
            m = live[:, None]
            if LOAD:
                tl.store(sa, tl.load(pa, mask=m), mask=m)
            else:
                tl.store(pa, tl.load(sa, mask=m), mask=m)
        else:
            head, r, inside, whole, edge = _edges_jit(p, c, k, live, LAYERS * UNIT_WORDS, BLOCK, VEC)
            lo = _layer_start_jit(layer_off_ptr, layer_first, layer_stride, r // UNIT_WORDS, inside, STRIDED)
            sa = split_ptr + (s[:, None] + lo + r % UNIT_WORDS)
            pa = packed_ptr + (tl.multiple_of(p - head + c * VEC, VEC)[:, None] + k[None, :])
            if LOAD:
                # Whole vectors at once (the mask is the same along one), edges word by word.
                vals = tl.where(whole, tl.load(pa, mask=whole), tl.load(pa, mask=edge))
                tl.store(sa, vals, mask=inside)
            else:
                vals = tl.load(sa, mask=inside)
                tl.store(pa, vals, mask=whole)
                tl.store(pa, vals, mask=edge)


def _layer_start(layer_off_ptr, layer_first, layer_stride, j, mask, STRIDED: tl.constexpr):
    """Word offset of layer `j` (any shape): `layer_first + j * layer_stride`, or read from the table."""
    return layer_first + j * layer_stride if STRIDED else tl.load(layer_off_ptr + j, mask=mask, other=0)


def _edges(p, c, k, live, SPAN: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Vector `c` (`[BLOCK]`) of the stacks at `p` (not aligned): `head` (their words before the first
    aligned vector), each word's place `r` in its stack and the masks `inside`, `whole`, `edge`."""
    head = p % VEC
    start = c * VEC - head  # stack word where this vector starts
    r = start[:, None] + k[None, :]
    inside = live[:, None] & (r >= 0) & (r < SPAN)
    whole = tl.broadcast_to((live & (start >= 0) & (start + VEC <= SPAN))[:, None], (BLOCK, VEC))
    edge = inside & ~whole
    return head, tl.where(inside, r, 0), inside, whole, edge


# Bound by `_kernel` (`ModeJit`): the Triton-wrapped helpers that the kernel calls.
_layer_start_jit: Any = None
_edges_jit: Any = None
_kernel = ModeJit(
    _copy_groups_kernel,
    _layer_start,
    _edges,
    do_not_specialize=["n_units", "packed_shift", "layer_first", "layer_stride"],
)


def layer_offsets(layers: Sequence[torch.Tensor]) -> list[int]:
    """Word offset of each of `layers` (1-D words tensors of one dtype) from the first one's start (any
    sign); `TransferError` where it is not whole words."""
    size = layers[0].element_size()
    base = layers[0].data_ptr()
    out = []
    for j, t in enumerate(layers):
        delta = t.data_ptr() - base
        if delta % size:
            raise TransferError(f"layer {j} starts {delta} bytes from the first, not whole {size}-byte words")
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
    """Move `len(layers)` layers of `n` units between packed stacks and per-layer rows.

    `packed`: `[packed_numel]` words, pinned CPU; `layers`: `G` tensors `[layer_numel]` of its
    dtype on one device, whole words apart; `packed_offsets`, `split_offsets`: `[n]` int64.
    `table`: `(base, [G] int64)` on the kernel's device, each layer's word offset from `base`
    (`layer_offsets`), uploaded once by the caller (None: from `layers[0]`, uploaded here).
    `units_per_program`: None for `units_in_flight`; the rest as `kernels.copy_rows`.
    """
    n = _check_call(
        packed, packed_offsets, layers, split_offsets, unit_words, packed_shift, sm_budget, units_per_program
    )
    base = layers[0] if table is None else table[0]
    deltas = layer_offsets([base, *layers])[1:]
    on_host = host_offsets(validate, packed_offsets, "copy_groups")
    if validate and n:  # every stack and row in bounds, the destinations disjoint
        span = len(layers) * unit_words
        validate_rows(packed_offsets + packed_shift, span, packed.numel(), "packed_offsets")
        for j, t in enumerate(layers):
            validate_rows(split_offsets, unit_words, t.numel(), f"split_offsets (layer {j})")
        if direction is Direction.LOAD:
            validate_disjoint(split_offsets, unit_words, "split_offsets")
        else:
            validate_disjoint(packed_offsets, span, "packed_offsets")
    if n == 0:
        return
    device = kernel_device(packed, layers[0], "copy_groups")
    known = common_alignment(packed_offsets.numpy(), split_offsets.numpy()) if on_host else offsets_align or 1
    units, kwargs = _group_shape(packed, base, deltas, unit_words, known | packed_shift, units_per_program)
    strided, stride, offsets = _layer_table(deltas, table, device)
    packed_off = to_kernel_device(packed_offsets, device)
    split_off = to_kernel_device(split_offsets, device)
    kwargs |= {"STRIDED": strided, "LOAD": direction is Direction.LOAD}
    # Strided: the table argument is never read; any int64 tensor stands in for it.
    table_arg = split_off if offsets is None else offsets
    args = (packed, packed_off, base, split_off, table_arg, deltas[0], stride, packed_shift, n)
    launch_on(device, _kernel(), min(sm_budget, -(-n // units)), args, kwargs)


def _check_call(
    packed: torch.Tensor,
    packed_offsets: torch.Tensor,
    layers: Sequence[torch.Tensor],
    split_offsets: torch.Tensor,
    unit_words: int,
    packed_shift: int,
    sm_budget: int,
    units_per_program: int | None,
) -> int:
    """The metadata checks of `copy_groups` (dtypes, devices, lengths, counts); returns `n`."""
    if not layers:
        raise TransferError("copy_groups needs at least one layer")
    check_words(packed, "packed")
    for j, t in enumerate(layers):
        check_words(t, f"layers[{j}]")
        if t.dtype != packed.dtype or t.device != layers[0].device:
            raise TransferError(
                f"layers[{j}] is {t.dtype} on {t.device}; expected {packed.dtype} on {layers[0].device}"
            )
    n = check_offsets(packed_offsets, split_offsets, ("packed_offsets", "split_offsets"), "units")
    check_count("unit_words", unit_words)
    check_count("sm_budget", sm_budget)
    check_count("packed_shift", packed_shift, least=0)
    check_count("units_per_program", units_per_program, optional=True)
    return n


def _layer_table(
    deltas: list[int], table: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device
) -> tuple[bool, int, torch.Tensor | None]:
    """`(strided, stride, offsets)`: layers evenly spaced (one allocation) go by a stride and need no
    table; others by `[G]` int64 offsets on `device` (the caller's table, or uploaded here)."""
    if table is not None and (table[1].numel() != len(deltas) or table[1].device != device):
        got = f"{tuple(table[1].shape)} on {table[1].device}"
        raise TransferError(f"table: [{len(deltas)}] offsets on {device} expected, got {got}")
    stride = deltas[1] - deltas[0] if len(deltas) > 1 else 0
    if all(d == deltas[0] + j * stride for j, d in enumerate(deltas)):
        return True, stride, None
    if table is None:
        return False, stride, to_kernel_device(torch.tensor(deltas, dtype=torch.int64), device)
    return False, stride, table[1]


def _group_shape(
    packed: torch.Tensor,
    base: torch.Tensor,
    deltas: list[int],
    unit_words: int,
    offset_bits: int,
    units_per_program: int | None,
) -> tuple[int, dict[str, Any]]:
    """Units per tile and the kernel's keyword arguments (but `STRIDED`, `LOAD`) for stacks of
    `len(deltas)` units of `unit_words` words at offsets that are multiples of `offset_bits`' lowest bit."""
    size, layers = packed.element_size(), len(deltas)
    vec = max(1, rules.VECTOR_BYTES // size)
    if packed.data_ptr() % rules.VECTOR_BYTES:
        vec = 1  # the packed side's vectors could not be aligned: word by word
    aligned = (
        vec > 1
        and unit_words % vec == 0
        and offset_bits % vec == 0
        and all(d % vec == 0 for d in deltas)
        and base.data_ptr() % rules.VECTOR_BYTES == 0
    )
    span = layers * unit_words
    vectors = span // vec if aligned else (span + 2 * vec - 2) // vec
    if vectors > rules.MAX_TILE_VECTORS:
        raise TransferError(
            f"a stack of {layers} layers x {unit_words * size} bytes is wider than one tile of the kernel "
            f"({rules.MAX_TILE_VECTORS} vectors of {vec * size} bytes); move fewer layers at once"
        )
    if units_per_program is None:
        units_per_program = units_in_flight(span * size)
    units = min(units_per_program, rules.MAX_TILE_VECTORS // vectors)
    block = next_power_of_2(units * vectors)
    kwargs = {
        "UNIT_WORDS": unit_words,
        "LAYERS": layers,
        "UNITS_PER_BLOCK": units,
        "VECTORS": vectors,
        "BLOCK": block,
        "VEC": vec,
        "ALIGNED": aligned,
        "num_warps": rules.warps_for(block * vec * size),
    }
    return units, kwargs
