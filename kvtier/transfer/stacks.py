"""Stacks: `page_first` runs of pages moved several layers at a time, through the staging buffer.

In `page_first` a host page of a buffer is `[L, page_size, *row]`. For `g` consecutive layers
a page's rows are one line of `g * page_size` rows (its stack), and the stacks of a run of
consecutive pages lie `L * page_size` rows apart; with every layer of the buffer in the call,
a run is one contiguous piece. One layer at a time the lines are a page's rows, short enough
that neither 2-D copies nor the row kernel reach the line rate (bench/FINDINGS.md); a call of
several layers moves the stacks instead:

- load: the copy engine copies each run's stacks into one half of the device pool's staging
  buffer of the direction (`[pages, g, page_size, *row]`: one piece per run where the stacks
  are contiguous, else one 2-D copy), then each of the `g` layers takes its rows there, on
  its device pages (one `index_copy_` for the layers of a pool's own allocation, else one
  per layer);
- backup: the reverse, each layer's rows gathered into the staging buffer first.

A window is one fill of a half; the halves alternate. On CUDA the device side runs on a
second stream of the direction, so the copy engine fills one half while the other is
placed or gathered; the call's stream waits for the last window, so work queued after the
call sees every row.

Planning (`stack_part`, `stacked_buffers`): both sides whole pages (a page's slots
consecutive from a page-aligned id), the call's layers `layers_per_call` of at least 2, and
per buffer runs worth a copy each: `PathCosts.stack_min_bytes` a run on average, and lines of
`stack_line_min_bytes` where the call has some of the buffer's layers (a 2-D copy). A copy of
each scattered page costs more than the row kernel's layer groups (bench/FINDINGS.md). A call
of other layers than planned still moves every row: its layers split into spans of at most
the window's layers.

Contract: as `execute`'s (stream-ordered, no device value read back, the plan alive until
its stream has run); two calls that use one direction's staging buffer must not run at
once on different streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from kvtier.errors import PlanError
from kvtier.pool.device import DevicePool, Direction
from kvtier.pool.host import HostLayout, HostPool
from kvtier.pool.rows import as_words, flat_words, word_dtype
from kvtier.spec import BufferSpec
from kvtier.transfer import cudart, dma, strided
from kvtier.transfer.options import PathCosts
from kvtier.transfer.parts import StackPart, StackRuns, Uploader, Window, cut_windows
from kvtier.transfer.runs import layer_spans

# Staging bytes are split into two halves aligned to this many bytes (16: the widest word).
_ALIGN = 16


def whole_pages(hn: np.ndarray, dn: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The first slot of each page of `hn`, `dn` (`[n]` int64 host and device slots), `[n // page_size]`
    int64 each, where both are whole pages; else None."""
    n = len(hn)
    if n == 0 or n % page_size:
        return None
    step = np.arange(page_size)
    for slots in (hn, dn):
        pages = slots.reshape(-1, page_size)
        if (pages[:, 0] % page_size).any() or (pages != pages[:, :1] + step).any():
            return None
    return hn[::page_size], dn[::page_size]


def half_bytes(device_pool: DevicePool) -> int:
    """Bytes of one half of a staging buffer (a window)."""
    return device_pool.staging(Direction.LOAD).numel() // 2 // _ALIGN * _ALIGN


def window_layers(host_pool: HostPool, device_pool: DevicePool, b: BufferSpec, layers_per_call: int) -> int:
    """Layers of `b` a window's stacks hold: the call's, at most the buffer's, as many as half holds."""
    page = host_pool.spec.page_size * b.row_bytes
    return min(layers_per_call, len(b.layers), half_bytes(device_pool) // page)


# A buffer's runs of host pages (`_page_runs`): `[runs]` int64 region, byte offset, pages.
PageRuns = tuple[np.ndarray, np.ndarray, np.ndarray]


def _page_runs(host_pool: HostPool, b: BufferSpec, heads: np.ndarray) -> PageRuns:
    """Runs of consecutive host pages in one region (`heads`: `[pages]` int64 first slots): `[runs]`
    int64 region, the byte offset of its first page in the region, and its pages."""
    region, row = host_pool.locate(b.name, heads)
    ps = host_pool.spec.page_size
    brk = np.ones(len(heads), dtype=bool)
    brk[1:] = (region[1:] != region[:-1]) | (heads[1:] != heads[:-1] + ps)
    first = np.flatnonzero(brk)
    return region[first], row[first] * b.row_bytes, np.diff(np.append(first, len(heads)))


def stacked_buffers(
    host_pool: HostPool,
    device_pool: DevicePool,
    costs: PathCosts,
    host_heads: np.ndarray,
    layers_per_call: int,
    raw_copies: bool,
) -> dict[str, PageRuns]:
    """The buffers a plan of pages `host_heads` (`[pages]` int64) moves as stacks, for calls of
    `layers_per_call` layers (see the module docstring), with their runs of pages; `raw_copies`:
    the process can make raw copy-engine copies (on CUDA)."""
    if host_pool.layout is not HostLayout.PAGE_FIRST or layers_per_call < 2:
        return {}
    cuda = device_pool.device.type == "cuda"
    if cuda and not (raw_copies and cudart.runtime() is not None):
        return {}
    out = {}
    ps = host_pool.spec.page_size
    for b in host_pool.spec.buffers:
        g = window_layers(host_pool, device_pool, b, layers_per_call)
        if g < 2 or not device_pool.raw_rows(b.name):
            continue
        line = g * ps * b.row_bytes
        if g < len(b.layers) and line < costs.stack_line_min_bytes:
            continue
        runs = _page_runs(host_pool, b, host_heads)
        if runs[2].mean() * line >= costs.stack_min_bytes:
            out[b.name] = runs
    return out


def planned(
    host_pool: HostPool,
    device_pool: DevicePool,
    costs: PathCosts,
    hn: np.ndarray,
    dn: np.ndarray,
    layers_per_call: int,
    up: Uploader,
    *,
    forced: bool,
    raw_copies: bool,
) -> StackPart | None:
    """The stack part of a plan of `hn`, `dn` (`[n]` int64 slots): of the buffers `stacked_buffers` picks,
    or of every buffer where `forced` (`PlanError` where it cannot be); None where none is stacked."""
    heads = whole_pages(hn, dn, host_pool.spec.page_size)
    if forced:
        why = _unstackable(host_pool, device_pool, heads)
        if why:
            raise PlanError(f"cannot force stacks: {why}")
        chosen = {b.name: _page_runs(host_pool, b, heads[0]) for b in host_pool.spec.buffers}
    elif heads is None:
        return None
    else:
        chosen = stacked_buffers(host_pool, device_pool, costs, heads[0], layers_per_call, raw_copies)
    if not chosen:
        return None
    return stack_part(host_pool, device_pool, chosen, heads[1], layers_per_call, costs, up)


def _unstackable(host_pool: HostPool, device_pool: DevicePool, heads: object) -> str:
    """Why a plan cannot be forced onto stacks ("" where it can)."""
    if host_pool.layout is not HostLayout.PAGE_FIRST:
        return f"the host pool is {host_pool.layout.value}, stacks need page_first"
    if heads is None:
        return "the slots are not whole pages on both sides"
    if device_pool.device.type == "cuda" and cudart.runtime() is None:
        return "no CUDA runtime to make 2-D copies with"
    ps = host_pool.spec.page_size
    if half_bytes(device_pool) < ps * host_pool.spec.widest_row_bytes:
        return f"half the staging buffer ({half_bytes(device_pool)} B) holds no page of one layer"
    raw = [b.name for b in host_pool.spec.buffers if not device_pool.raw_rows(b.name)]
    return f"the device tensors of {raw} are not packed rows" if raw else ""


def stack_part(
    host_pool: HostPool,
    device_pool: DevicePool,
    chosen: dict[str, PageRuns],
    device_heads: np.ndarray,
    layers_per_call: int,
    costs: PathCosts,
    up: Uploader,
) -> StackPart:
    """The buffers `chosen` (name -> its runs of host pages) of a plan of whole pages as stacks
    (`device_heads`: `[pages]` int64, each page's first device slot), windows sized for calls of
    `layers_per_call` layers."""
    ps = host_pool.spec.page_size
    runs = {}
    for b in host_pool.spec.buffers:
        if b.name not in chosen:
            continue
        g = window_layers(host_pool, device_pool, b, layers_per_call)
        region, host, pages = chosen[b.name]
        cap = half_bytes(device_pool) // (g * ps * b.row_bytes)
        run, off, cut_pages, stage, windows = cut_windows(pages, cap)
        pitch = len(b.layers) * ps * b.row_bytes
        host_at = host[run] + off * pitch
        # Streams of a window's pieces (all of the buffer's layers in a call): fanned out where short.
        fan = costs.copy_streams if cut_pages.mean() * pitch < costs.fan_out_below_bytes else 1
        runs[b.name] = StackRuns(g, region[run], host_at, stage, cut_pages, windows, fan)
    device_pages = up(torch.from_numpy(device_heads // ps))
    return StackPart(rows=len(device_heads) * ps, runs=runs, device_pages=device_pages)


def move(
    direction: Direction,
    part: StackPart,
    host_pool: HostPool,
    device_pool: DevicePool,
    b: BufferSpec,
    local: list[int],
    stream: torch.cuda.Stream | None,
) -> None:
    """Buffer `b`'s stacks of local layers `local` (ascending), in spans of consecutive layers of at most
    the window's, on `stream` (None: the CPU)."""
    runs = part.runs[b.name]
    for lo, hi in layer_spans(local, runs.layers):
        span = _Span(direction, part, host_pool, device_pool, b, lo, hi, stream)
        with span.on_side():
            for w, window in enumerate(runs.windows):
                span.window(w, window)


_SIDE_STREAMS: dict[tuple[int, Direction], torch.cuda.Stream] = {}


class _Span:
    """Layers `[lo, hi)` of one buffer, window by window through the two halves of the staging buffer:
    what every window shares, computed once (views, addresses), and the events that hand each half
    between the call's stream (the copy engine) and the side stream (the device side)."""

    def __init__(
        self,
        direction: Direction,
        part: StackPart,
        host_pool: HostPool,
        device_pool: DevicePool,
        b: BufferSpec,
        lo: int,
        hi: int,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self.load, self.part, self.runs = direction is Direction.LOAD, part, part.runs[b.name]
        self.host_pool, self.b, self.lo, self.hi = host_pool, b, lo, hi
        ps, g = host_pool.spec.page_size, hi - lo
        self.line, self.pitch = g * ps * b.row_bytes, len(b.layers) * ps * b.row_bytes
        word = word_dtype(b.row_bytes)
        row_words = b.row_bytes // word.itemsize
        half = half_bytes(device_pool)
        raw = device_pool.staging(direction)
        cap = half // self.line
        self.halves = [
            raw[k * half : k * half + cap * self.line].view(word).view(cap, g, ps, row_words) for k in (0, 1)
        ]
        whole = device_pool.num_slots // ps * ps
        stacked = device_pool.stacked(b.name)
        if stacked is not None:  # every layer of the span in one op
            flat = stacked.view(stacked.shape[0], device_pool.num_slots, -1).view(torch.uint8).view(word)
            self.dev = [flat[lo:hi, :whole].view(g, whole // ps, ps, row_words)]
        else:
            pages = whole // ps
            self.dev = [
                as_words(device_pool.layer(b.name, b.layers[j]))[:whole].view(pages, ps, row_words)
                for j in range(lo, hi)
            ]
        self.host_ptrs = host_pool.region_ptrs(b.name)[lo] if stream is not None else None
        self.stream, self.side = stream, None
        if stream is not None:
            index = device_pool.device.index
            key = (torch.cuda.current_device() if index is None else index, direction)
            self.side = _SIDE_STREAMS.get(key)
            if self.side is None:
                self.side = _SIDE_STREAMS[key] = torch.cuda.Stream(key[0])
        self.freed: list[torch.cuda.Event | None] = [None, None]  # per half: its last use done

    @contextlib.contextmanager
    def on_side(self) -> Iterator[None]:
        """Torch ops inside go to the side stream, which first waits for the call's stream; on leaving,
        the call's stream waits for the side's last work (nothing on the CPU)."""
        if self.stream is None:
            yield
            return
        _hand(self.stream, self.side)
        with torch.cuda.stream(self.side):
            yield
        _hand(self.side, self.stream)

    def window(self, w: int, window: Window) -> None:
        """One window through half `w % 2`."""
        stage = self.halves[w % 2][: window.hi - window.lo]
        index = self.part.device_pages[window.lo : window.hi]
        freed = self.freed[w % 2]
        if self.load:
            if freed is not None:
                self.stream.wait_event(freed)
            self._copies(window, stage)
            _hand(self.stream, self.side)
            self._device_side(index, stage)
            self.freed[w % 2] = _record(self.side)
        else:
            if freed is not None:
                self.side.wait_event(freed)
            self._device_side(index, stage)
            _hand(self.side, self.stream)
            self._copies(window, stage)
            self.freed[w % 2] = _record(self.stream)

    def _device_side(self, index: torch.Tensor, stage: torch.Tensor) -> None:
        """The span's layers on device pages `index` (`[pages]` int64) to or from `stage`
        (`[pages, hi - lo, page_size, W]` words), on the current stream."""
        if self.dev[0].dim() == 4:  # `[layers, pages, page_size, W]`: one op
            (dev,) = self.dev
            if self.load:
                dev.index_copy_(1, index, stage.transpose(0, 1))
            else:
                stage.copy_(dev.index_select(1, index).transpose(0, 1))
            return
        for j, dev in enumerate(self.dev):
            if self.load:
                dev.index_copy_(0, index, stage[:, j])
            else:
                stage[:, j].copy_(dev.index_select(0, index))

    def _copies(self, window: Window, stage: torch.Tensor) -> None:
        """The window's runs between the host and `stage`, by the copy engine on the call's stream (torch
        copies of strided views on the CPU)."""
        runs, first, end = self.runs, window.first, window.end
        region, host, at, pages = (x[first:end] for x in (runs.region, runs.host, runs.stage, runs.pages))
        if self.stream is None:
            _torch_copies(self.host_pool, self.b, self.lo, self.hi, region, host, at, pages, stage, self.load)
            return
        host_ptrs = self.host_ptrs[region] + host
        stage_ptrs = stage.data_ptr() + at * self.line
        if self.line == self.pitch:  # every layer of the buffer: each run one piece
            dst, src = (stage_ptrs, host_ptrs) if self.load else (host_ptrs, stage_ptrs)
            dma.copy_runs(dst, src, pages * self.line, self.stream, streams=runs.streams)
            return
        line, pitch = self.line, self.pitch
        for h, s, n in zip(host_ptrs.tolist(), stage_ptrs.tolist(), pages.tolist(), strict=True):
            if self.load:
                strided.copy_2d(s, line, h, pitch, line, n, self.stream)
            else:
                strided.copy_2d(h, pitch, s, line, line, n, self.stream)


def _hand(src: torch.cuda.Stream | None, dst: torch.cuda.Stream | None) -> None:
    """`dst` waits for the work queued on `src` so far (nothing on the CPU)."""
    if src is not None and dst is not None:
        dst.wait_event(_record(src))


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _torch_copies(
    host_pool: HostPool,
    b: BufferSpec,
    lo: int,
    hi: int,
    region: np.ndarray,
    host: np.ndarray,
    at: np.ndarray,
    pages: np.ndarray,
    stage: torch.Tensor,
    load: bool,
) -> None:
    """`_copies` on the CPU: each run's stacks as a strided view of its region."""
    ps, layers, g = host_pool.spec.page_size, len(b.layers), hi - lo
    words = stage.shape[3]
    for r, h, s, n in zip(region.tolist(), host.tolist(), at.tolist(), pages.tolist(), strict=True):
        flat = flat_words(host_pool.region_words(b.name, b.layers[lo], r), stage.element_size())
        start = flat.storage_offset() + h // stage.element_size()
        view = flat.as_strided((n, g, ps, words), (layers * ps * words, ps * words, words, 1), start)
        if load:
            stage[s : s + n].copy_(view)
        else:
            view.copy_(stage[s : s + n])
