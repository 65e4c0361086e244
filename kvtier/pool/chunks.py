"""A host pool's memory: how it is cut into chunks, checked against the host's RAM and allocated.

`HostChunks` owns every buffer's chunk tensors for one `HostPool` (which holds it and reads the
rows through it; the addressing of rows, regions and pages stays in `kvtier.pool.host`). It
plans every chunk first (shapes only), refuses with `HostMemoryError` a pool larger than the
host's available memory minus a reserve, and only then allocates: nothing is allocated before
the plan and the memory check pass, and on a failed allocation the chunks made so far go back
to the OS before the error propagates.

Chunks are at most `chunk_bytes` each, never one giant allocation: large pins fail on some
drivers and stall the host. A pinned pool's chunks are all pinned; a failed pin raises
`PinError` and is never replaced by pageable memory.

Layouts (per buffer, `L` = the buffer's layers), `segment_slots` long aligned segments each:
- `layer_first`: `[L, slots, *row]` cut by slots into segments (the whole pool unless one
  layer of a buffer exceeds a chunk) and by layers into groups that fit a chunk.
- `page_first`: `[pages, L, page_size, *row]`, whole pages per chunk; a segment is one page.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from kvtier.errors import HostMemoryError, InvariantError, LayoutError, PinError, SpecError
from kvtier.pool.memory import default_reserve_bytes, fmt_bytes, host_memory_bytes, return_freed_memory
from kvtier.spec import BufferSpec, KVSpec

log = logging.getLogger(__name__)


class HostLayout(str, Enum):
    """How a `HostPool` lays out each buffer."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"

    @classmethod
    def parse(cls, value: HostLayout | str) -> HostLayout:
        try:
            return cls(value)
        except ValueError:
            raise LayoutError(f"unknown host layout {value!r}; known: {[m.value for m in cls]}") from None


# A chunk to allocate: (shape, layer_lo, layer_hi, slot_lo, slot_hi), as `Chunk` holds them.
_ChunkPlan = tuple[tuple[int, ...], int, int, int, int]


@dataclass(frozen=True)
class Chunk:
    """One allocation: `tensor` holds layers `[layer_lo, layer_hi)` of slots `[slot_lo, slot_hi)`."""

    tensor: torch.Tensor
    layer_lo: int
    layer_hi: int
    slot_lo: int
    slot_hi: int


class HostChunks:
    """Every buffer's chunks of a host pool of `num_slots` slots of `spec`; see the module docstring.

    `pinned`: allocate pinned memory (the caller checked that CUDA is there).
    `reserve_bytes`: host memory to leave free (None: `memory.default_reserve_bytes`).
    `progress(done_bytes, total_bytes)` is called after each chunk.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        layout: HostLayout,
        chunk_bytes: int,
        pinned: bool,
        reserve_bytes: int | None,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        self.spec, self.num_slots, self.layout = spec, num_slots, layout
        self.chunk_bytes, self.pinned = chunk_bytes, pinned
        if layout is HostLayout.LAYER_FIRST:
            self.segment_slots = self._layer_first_span()
            plans = {b.name: self._layer_first_chunks(b) for b in spec.buffers}
        else:
            self.segment_slots = spec.page_size
            plans = {b.name: self._page_first_chunks(b) for b in spec.buffers}
        self.footprint_bytes = sum(_nbytes(s, b.dtype) for b in spec.buffers for s, *_ in plans[b.name])

        available, total = host_memory_bytes()
        reserve = default_reserve_bytes(total) if reserve_bytes is None else reserve_bytes
        if self.footprint_bytes > available - reserve:
            usable = fmt_bytes(max(available - reserve, 0))
            raise HostMemoryError(
                f"host pool needs {fmt_bytes(self.footprint_bytes)} but only {usable} may be used "
                f"({fmt_bytes(available)} available minus a reserve of {fmt_bytes(reserve)})"
            )
        self.by_buffer = self._allocate_chunks(plans, progress)

    @property
    def count(self) -> int:
        """Chunks over every buffer."""
        return sum(len(c) for c in self.by_buffer.values())

    def of(self, buffer: str) -> list[Chunk]:
        """The chunks of `buffer`, in slot order (layer groups of a segment first); `SpecError` for
        a buffer the spec lacks."""
        try:
            return self.by_buffer[buffer]
        except KeyError:
            raise SpecError(f"host pool has no buffer {buffer!r}; it has {list(self.by_buffer)}") from None

    def release(self) -> None:
        """Drop every chunk and hand the freed memory back to the OS now (a view taken before keeps its
        chunk alive); the chunks are empty after."""
        self.by_buffer = {}
        return_freed_memory(self.pinned)

    def at(self, buffer: str, local: int, slot: int) -> Chunk:
        """The chunk of `buffer` that holds local layer `local` of `slot`."""
        for c in self.of(buffer):
            if c.layer_lo <= local < c.layer_hi and c.slot_lo <= slot < c.slot_hi:
                return c
        raise InvariantError(f"host pool: no chunk holds slot {slot} of {buffer!r} on local layer {local}")

    def _allocate_chunks(
        self, plans: dict[str, list[_ChunkPlan]], progress: Callable[[int, int], None] | None
    ) -> dict[str, list[Chunk]]:
        """Every chunk of `plans`; on a failure the chunks made so far go back to the OS first."""
        out: dict[str, list[Chunk]] = {}
        done = 0
        try:
            for b in self.spec.buffers:
                chunks = out[b.name] = []
                for shape, layer_lo, layer_hi, slot_lo, slot_hi in plans[b.name]:
                    tensor = self._allocate(shape, b.dtype)
                    chunks.append(Chunk(tensor, layer_lo, layer_hi, slot_lo, slot_hi))
                    done += tensor.nbytes
                    log.debug(
                        "host pool: %s of %s allocated", fmt_bytes(done), fmt_bytes(self.footprint_bytes)
                    )
                    if progress is not None:
                        progress(done, self.footprint_bytes)
        except BaseException:
            # The traceback keeps this frame alive: drop its references before freeing.
            for chunks in out.values():
                chunks.clear()
            out.clear()
            tensor = None
            return_freed_memory(self.pinned)
            raise
        return out

    def _layer_first_span(self) -> int:
        """Slots per segment: the whole pool unless one layer of a buffer exceeds a chunk."""
        widest = self.spec.widest_row_bytes
        if widest * self.num_slots <= self.chunk_bytes:
            return self.num_slots
        ps = self.spec.page_size
        span = self.chunk_bytes // widest // ps * ps
        if span == 0:
            raise SpecError(
                f"host pool: one page of {ps} rows of {widest} B exceeds a chunk of {self.chunk_bytes} B"
            )
        return span

    def _layer_first_chunks(self, b: BufferSpec) -> list[_ChunkPlan]:
        span = self.segment_slots
        layers = len(b.layers)
        group = max(1, min(layers, self.chunk_bytes // (span * b.row_bytes)))
        out = []
        for layer_lo in range(0, layers, group):
            layer_hi = min(layers, layer_lo + group)
            for slot_lo in range(0, self.num_slots, span):
                slot_hi = min(self.num_slots, slot_lo + span)
                shape = (layer_hi - layer_lo, slot_hi - slot_lo, *b.row_shape)
                out.append((shape, layer_lo, layer_hi, slot_lo, slot_hi))
        return out

    def _page_first_chunks(self, b: BufferSpec) -> list[_ChunkPlan]:
        ps = self.spec.page_size
        layers = len(b.layers)
        page_bytes = layers * ps * b.row_bytes
        per_chunk = self.chunk_bytes // page_bytes
        if per_chunk == 0:
            raise SpecError(
                f"host pool: one page of buffer {b.name!r} ({page_bytes} B) "
                f"exceeds a chunk of {self.chunk_bytes} B"
            )
        pages = self.num_slots // ps
        out = []
        for page_lo in range(0, pages, per_chunk):
            page_hi = min(pages, page_lo + per_chunk)
            shape = (page_hi - page_lo, layers, ps, *b.row_shape)
            out.append((shape, 0, layers, page_lo * ps, page_hi * ps))
        return out

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One chunk: zeroed, `shape` of `dtype` over a uint8 allocation (pinned where the pool is)."""
        nbytes = _nbytes(shape, dtype)
        try:
            raw = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError as e:
            if self.pinned:
                raise PinError(f"pinning a host chunk of {fmt_bytes(nbytes)} failed: {e}") from e
            raise HostMemoryError(f"allocating a host chunk of {fmt_bytes(nbytes)} failed: {e}") from e
        if self.pinned and not raw.is_pinned():
            raise PinError(f"a host chunk of {fmt_bytes(nbytes)} came back unpinned")
        return raw.view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
