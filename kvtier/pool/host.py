"""The host tier: KV rows in (pinned) host memory, in one of two layouts, and their addresses.

`HostPool` holds its memory through `HostChunks` (`kvtier.pool.chunks`: the chunks of at most
`chunk_bytes`, 1 GiB by default, planned, checked against the host's RAM and allocated; with
CUDA present every chunk is pinned, a failed pin raises `PinError`) and owns how rows are
found in it: segments, regions and pages for the transfer paths and the storage tier, and
row copies for tests.

Layouts (per buffer, `L` = the buffer's layers):
- `layer_first`: `[L, slots, *row]`. A layer's rows for a range of slots are one
  contiguous slab, so a contiguous run of slots reloads in one copy.
- `page_first`: `[pages, L, page_size, *row]`. All layers of a page sit together,
  the shape a storage tier wants; one layer's rows are contiguous within a page.

Both layouts are cut into "segments": maximal slot ranges whose rows for one layer
are contiguous in memory (`segment_slots` long, aligned). A transfer plan splits
its runs at segment boundaries; `segment()` returns the slab of one segment.

Lifetime: `close()` (or leaving a `with` block) drops every chunk and hands the memory
back to the operating system at once (`HostChunks.release`). After `close()`
every access to rows or addresses raises `ClosedError` instead of handing out an address
of freed memory; a view taken before keeps its chunk alive, an address taken before dangles.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from kvtier.errors import ClosedError, PinError, SlotError, SpecError
from kvtier.pool.chunks import Chunk, HostChunks, HostLayout
from kvtier.pool.memory import Owner, fmt_bytes
from kvtier.pool.rows import as_words, word_dtype
from kvtier.spec import BufferSpec, KVSpec

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 30  # 1 GiB


class HostPool(Owner):
    """KV rows of `num_slots` tokens for every buffer and layer of `spec`, on the host.

    `pin=None` pins exactly when CUDA is available; `pin=True` without CUDA is an
    error. `progress(done_bytes, total_bytes)` is called after each chunk.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        layout: HostLayout | str = HostLayout.LAYER_FIRST,
        *,
        pin: bool | None = None,
        reserve_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.layout = HostLayout.parse(layout)
        ps = spec.page_size
        if num_slots <= 0 or num_slots % ps:
            raise SpecError(f"host pool: num_slots {num_slots} must be a positive multiple of page_size {ps}")
        if chunk_bytes <= 0:
            raise SpecError(f"host pool: chunk_bytes {chunk_bytes} must be positive")
        self.num_slots = num_slots
        self.chunk_bytes = chunk_bytes
        cuda = torch.cuda.is_available()
        pin = cuda if pin is None else pin
        if pin and not cuda:
            raise PinError("host pool: pin=True needs CUDA, and no CUDA device is available")
        self.pinned = pin

        self._chunks = HostChunks(spec, num_slots, self.layout, chunk_bytes, pin, reserve_bytes, progress)
        self.segment_slots = self._chunks.segment_slots
        self.footprint_bytes = self._chunks.footprint_bytes
        self._region_ptrs = {b.name: self._build_region_ptrs(b) for b in spec.buffers}
        self._region_classes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._pages: list | None = None  # `_page_map`, made when first needed
        log.info(
            "host pool: %d slots, layout %s, %s in %d chunks, pinned=%s",
            num_slots,
            self.layout.value,
            fmt_bytes(self.footprint_bytes),
            self._chunks.count,
            self.pinned,
        )

    def close(self) -> None:
        """Drop every chunk and return its memory to the OS now; idempotent."""
        if self._closed:
            return
        chunks = self._chunks.count
        self._closed = True
        self._region_ptrs, self._region_classes, self._pages = {}, {}, None
        self._chunks.release()
        log.info("host pool closed: %s in %d chunks released", fmt_bytes(self.footprint_bytes), chunks)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"host pool of {self.spec.name!r} ({self.num_slots} slots) was closed")

    def chunks(self, buffer: str) -> list[torch.Tensor]:
        """The raw chunk tensors of one buffer (for tests and inspection)."""
        return [c.tensor for c in self._chunks_of(buffer)]

    def _chunks_of(self, buffer: str) -> list[Chunk]:
        self._check_open()
        return self._chunks.of(buffer)

    def num_segments(self) -> int:
        return -(-self.num_slots // self.segment_slots)

    def segment(self, buffer: str, layer: int, index: int) -> torch.Tensor:
        """Rows of model layer `layer` for segment `index`: `[segment length, *row]`, contiguous."""
        self._check_open()
        local = self.spec.buffer(buffer).local_layer(layer)
        slot = index * self.segment_slots
        if not 0 <= slot < self.num_slots:
            raise SpecError(f"host pool: segment {index} is outside [0, {self.num_segments()})")
        c = self._chunk_at(buffer, local, slot)
        if self.layout is HostLayout.LAYER_FIRST:
            rel = slot - c.slot_lo
            return c.tensor[local - c.layer_lo, rel : rel + self.segment_slots]
        return c.tensor[(slot - c.slot_lo) // self.spec.page_size, local]

    def _chunk_at(self, buffer: str, local: int, slot: int) -> Chunk:
        self._check_open()
        return self._chunks.at(buffer, local, slot)

    def locate(self, buffer: str, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where rows live: `(region [n], row [n])`, both int64, for `slots` (`[n]` int64).

        A region is one allocation of the buffer; `row` counts rows of the buffer's
        width from the region's first row of a layer (`region_words`), so a row's
        address is `region_words(buffer, layer, region)[row * W : (row + 1) * W]`
        for every layer alike.
        """
        region_slots, page, page_rows = self.row_map(buffer)
        region = slots // region_slots
        rel = slots - region * region_slots
        if page == region_slots:
            return region, rel
        return region, (rel // page) * page_rows + rel % page

    def row_map(self, buffer: str) -> tuple[int, int, int]:
        """`(region slots, page, page rows)`: how `locate` maps a slot to its region and row.

        region = slot // region slots; within it, slot r is row (r // page) * page rows
        + r % page (layer-first: page = region slots, so the row is r).
        """
        self._check_open()
        b = self.spec.buffer(buffer)
        if self.layout is HostLayout.LAYER_FIRST:
            return self.segment_slots, self.segment_slots, self.segment_slots
        chunk = self._chunks_of(buffer)[0]
        ps = self.spec.page_size
        return chunk.slot_hi - chunk.slot_lo, ps, len(b.layers) * ps

    def _build_region_ptrs(self, b: BufferSpec) -> np.ndarray:
        chunks = self._chunks.of(b.name)
        layers = len(b.layers)
        if self.layout is HostLayout.PAGE_FIRST:
            ps = self.spec.page_size
            out = np.array(
                [[c.tensor.data_ptr() + j * ps * b.row_bytes for c in chunks] for j in range(layers)],
                dtype=np.int64,
            )
        else:
            out = np.zeros((layers, self.num_segments()), dtype=np.int64)
            for c in chunks:
                k = c.slot_lo // self.segment_slots
                for j in range(c.layer_lo, c.layer_hi):
                    out[j, k] = c.tensor.data_ptr() + (j - c.layer_lo) * (c.slot_hi - c.slot_lo) * b.row_bytes
        out.flags.writeable = False
        return out

    def region_ptrs(self, buffer: str) -> np.ndarray:
        """`[layers, regions]` int64, read-only: `region_words(...).data_ptr()` of each, computed once."""
        self._chunks_of(buffer)  # open, and a buffer of the spec
        return self._region_ptrs[buffer]

    def region_classes(self, buffer: str) -> tuple[np.ndarray, np.ndarray]:
        """How the regions of `buffer` lie apart on each layer: the distinct rows of `region_ptrs(buffer)`
        less its first column (`[c, regions]` int64) and each layer's row among them (`[layers]` int64).
        Layers of one class share the byte offsets of their rows from their first region's start."""
        found = self._region_classes.get(buffer)
        if found is None:
            ptrs = self.region_ptrs(buffer)
            classes, layer_class = np.unique(ptrs - ptrs[:, :1], axis=0, return_inverse=True)
            found = self._region_classes[buffer] = (classes, layer_class.reshape(-1))
        return found

    def region_words(self, buffer: str, layer: int, region: int) -> torch.Tensor:
        """1-D words of one region, from its first row of `layer` to the end of its allocation."""
        b = self.spec.buffer(buffer)
        local = b.local_layer(layer)
        dtype = word_dtype(b.row_bytes)
        row_words = b.row_bytes // dtype.itemsize
        if self.layout is HostLayout.LAYER_FIRST:
            c = self._chunk_at(buffer, local, region * self.segment_slots)
            start = (local - c.layer_lo) * (c.slot_hi - c.slot_lo) * row_words
            return _flat_words(c.tensor, dtype)[start:]
        c = self._chunks_of(buffer)[region]
        return _flat_words(c.tensor, dtype)[local * self.spec.page_size * row_words :]

    def page_views(self, slot: int) -> list[memoryview]:
        """The bytes of the page starting at `slot`, writable uint8 views into the pool.

        In the order of a storage value's payload: buffer by buffer, each buffer's layers in
        order, each layer's `page_size` rows (one view per buffer in `page_first`, one per
        buffer and layer in `layer_first`). A view keeps its chunk alive.
        """
        self._check_open()
        ps = self.spec.page_size
        if isinstance(slot, bool) or not 0 <= slot < self.num_slots or slot % ps:
            raise SlotError(f"page_views({slot!r}): not the first slot of a page in [0, {self.num_slots})")
        out: list[memoryview] = []
        for raw, lo, hi, per_slot, stride, n, count in self._page_map():
            if lo <= slot < hi:
                at = (slot - lo) * per_slot
                out.extend(raw[at + k * stride : at + k * stride + n] for k in range(count))
        return out

    def _page_map(self) -> list[tuple[memoryview, int, int, int, int, int, int]]:
        """Per chunk, in payload order: `(bytes, slot_lo, slot_hi, bytes per slot, stride between
        views, bytes per view, views per page)`, so `page_views` is arithmetic and slicing only."""
        if self._pages is None:
            ps, out = self.spec.page_size, []
            for b in self.spec.buffers:
                row, layers = b.row_bytes, len(b.layers)
                for c in self._chunks_of(b.name):
                    raw = memoryview(c.tensor.view(-1).view(torch.uint8).numpy())
                    if self.layout is HostLayout.PAGE_FIRST:  # [pages, L, ps, row]: one view a page
                        out.append((raw, c.slot_lo, c.slot_hi, layers * row, 0, ps * layers * row, 1))
                    else:  # [L, slots, row]: one view a layer
                        stride, count = (c.slot_hi - c.slot_lo) * row, c.layer_hi - c.layer_lo
                        out.append((raw, c.slot_lo, c.slot_hi, row, stride, ps * row, count))
            self._pages = out
        return self._pages

    def gather(self, buffer: str, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Copy of the rows at `slots` (`[n]` int64, CPU) of one layer: `[n, *row]`, pageable."""
        self._check_open()
        b = self.spec.buffer(buffer)
        out = torch.empty((slots.numel(), b.row_bytes), dtype=torch.uint8)
        out_w = as_words(out)
        for view, rel, mask in self._split(buffer, layer, slots):
            seg = view.shape[1]
            out_w[mask] = view[rel // seg, rel % seg]
        return out.view(b.dtype).view(slots.numel(), *b.row_shape)

    def scatter(self, buffer: str, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` (`[n, *row]` of the buffer's dtype) to `slots` (`[n]` int64, CPU, distinct)."""
        self._check_open()
        b = self.spec.buffer(buffer)
        if rows.dtype != b.dtype or tuple(rows.shape) != (slots.numel(), *b.row_shape):
            raise SpecError(
                f"host pool: rows {rows.dtype} {tuple(rows.shape)} do not match buffer {buffer!r} "
                f"{b.dtype} {(slots.numel(), *b.row_shape)}"
            )
        rows_w = as_words(rows.contiguous())
        for view, rel, mask in self._split(buffer, layer, slots):
            seg = view.shape[1]
            view[rel // seg, rel % seg] = rows_w[mask]

    def _split(self, buffer: str, layer: int, slots: torch.Tensor):
        """Per chunk holding some of `slots`: `(words [segments, segment_slots, W], slot - slot_lo, mask)`."""
        local = self.spec.buffer(buffer).local_layer(layer)
        for c in self._chunks_of(buffer):
            if self.layout is HostLayout.PAGE_FIRST:
                view = _words3(c.tensor[:, local])
            elif c.layer_lo <= local < c.layer_hi:
                view = _words3(c.tensor[local - c.layer_lo].unsqueeze(0))
            else:
                continue
            mask = (slots >= c.slot_lo) & (slots < c.slot_hi)
            if bool(mask.any()):
                yield view, slots[mask] - c.slot_lo, mask

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"HostPool({self.spec.name}, slots={self.num_slots}, layout={self.layout.value}, "
            f"{fmt_bytes(self.footprint_bytes)}, pinned={self.pinned}{state})"
        )


def _flat_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous allocation as 1-D words of `dtype`."""
    return t.reshape(-1).view(torch.uint8).view(dtype)


def _words3(view: torch.Tensor) -> torch.Tensor:
    """`[a, b, *row]` with packed rows as `[a, b, W]` words (dim 0 may stay strided)."""
    flat = view.flatten(2) if view.dim() > 3 else view
    if flat.dim() == 2:
        flat = flat.unsqueeze(-1)
    raw = flat.view(torch.uint8)
    return raw.view(word_dtype(raw.shape[-1]))
