"""Copy-engine transfers of many runs at once.

One `cudaMemcpyBatchAsync` (CUDA 12.8+) submits every run of a layer in a single
call, so the host cost no longer grows with one Python copy per run. With a CUDA 13
runtime loaded in the process it is called directly on the arrays' memory (`cudart`;
0.5 us of host time per copy on an H200 host), else through `cuda.bindings` (1.4 us
per copy: its list arguments are converted one Python int at a time). Where the
batch call is missing (older runtime or bindings, or no `cuda.bindings` at all) the
same runs go through a loop of `cudaMemcpyAsync`, and without `cuda.bindings`
through `torch` copies.

Fan-out: one stream feeds one copy engine, which pays a fixed cost per copy (0.72 of
the line rate at 74 KB copies, 0.85-0.92 at 295 KB, on an H200). `copy_runs(...,
streams=k)` splits the list over the caller's stream and `k - 1` side streams that
fork from it and join back into it, so several copy engines overlap their per-copy
gaps: 0.94-0.99 at 74 KB and 295 KB with 8 streams (bench/NOTES.md). The caller's
stream still orders everything: side streams start after the work already queued on
it, and work queued on it afterwards waits for every side stream.

The batch call rejects the legacy default stream ("invalid value"): callers pass
a stream they created; `copy_runs` refuses the default stream up front.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from enum import Enum

import numpy as np
import torch

from kvtier.transfer import cudart

log = logging.getLogger(__name__)


class DmaMode(str, Enum):
    """Which host API submits a list of copies."""

    BATCH = "batch"  # one cudaMemcpyBatchAsync per call
    LOOP = "loop"  # one cudaMemcpyAsync per run
    TORCH = "torch"  # one torch copy per run (no cuda.bindings)


# Up to this many copies go out as plain `cudaMemcpyAsync` calls even where batching exists
# (through `cuda.bindings`, whose batch call converts its lists one Python int at a time).
SMALL_BATCH = 4
# The same with the runtime's batch call made directly: on an H200 host one batch of k copies
# costs less than k plain calls from k = 2 (2.5 against 4.9 us a layer, 5.5 against 6.7 at 4,
# in C; bench/NOTES.md).
SMALL_BATCH_DIRECT = 1

_runtime = None
_mode: DmaMode | None = None
_attrs = None


def _probe() -> DmaMode:
    """Find the best mode once per process."""
    global _runtime, _mode, _attrs
    if _mode is not None:
        return _mode
    try:
        from cuda.bindings import runtime
    except ImportError:
        _mode = DmaMode.TORCH
        return _mode
    _runtime = runtime
    _mode = DmaMode.LOOP
    if hasattr(runtime, "cudaMemcpyBatchAsync") and hasattr(runtime, "cudaMemcpyAttributes"):
        attrs = runtime.cudaMemcpyAttributes()
        attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        # The copies run beside the model's kernels; ask the driver to favour overlap.
        attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        _attrs = attrs
        _mode = DmaMode.BATCH
    log.info("batched DMA mode: %s", _mode.value)
    return _mode


def small_batch() -> int:
    """Copies up to which a list goes out as plain `cudaMemcpyAsync` calls, not one batch."""
    if _probe() is not DmaMode.BATCH:
        return SMALL_BATCH
    return SMALL_BATCH_DIRECT if _direct_batch() is not None else SMALL_BATCH


def dma_mode() -> DmaMode:
    """The mode `copy_runs` uses on this machine."""
    return _probe() if torch.cuda.is_available() else DmaMode.TORCH


def copy_runs(
    dst_ptrs: np.ndarray,
    src_ptrs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
    mode: DmaMode | None = None,
    streams: int = 1,
) -> None:
    """Copy `sizes[i]` bytes from `src_ptrs[i]` to `dst_ptrs[i]` for every i, on `stream`.

    `dst_ptrs`, `src_ptrs`, `sizes`: `[n]` uint64/int64 numpy arrays of raw addresses
    and byte counts (pinned host or device memory, any direction). Copies within one
    call must not overlap: their order is not defined. `streams` > 1 spreads the list
    over that many streams forked from and joined into `stream`, in contiguous shares
    of about equal bytes (when there are at least two copies per stream).
    """
    if _spread(dst_ptrs, src_ptrs, sizes, stream, streams, functools.partial(copy_runs, mode=mode)):
        return
    n = len(sizes)
    global _mode
    mode = mode or _probe()
    if mode is DmaMode.BATCH and n <= small_batch():
        mode = DmaMode.LOOP  # a few plain calls cost less than building one batch
    rt = _runtime
    direct = _direct_batch() if mode is DmaMode.BATCH else None
    if direct is not None:
        direct(dst_ptrs, src_ptrs, sizes, stream.cuda_stream)
    elif mode is DmaMode.BATCH:
        try:
            err, *_ = rt.cudaMemcpyBatchAsync(
                dst_ptrs.tolist(),
                src_ptrs.tolist(),
                sizes.tolist(),
                n,
                [_attrs],
                [0],
                1,
                _handle(stream),
            )
        except TypeError as e:
            # Bindings of another CUDA release take other arguments: use the loop from now on.
            log.warning("cudaMemcpyBatchAsync not usable through these bindings (%s); looping instead", e)
            _mode = DmaMode.LOOP
            copy_runs(dst_ptrs, src_ptrs, sizes, stream, DmaMode.LOOP)
            return
        _check(err, "cudaMemcpyBatchAsync")
    elif mode is DmaMode.LOOP:
        flat = np.stack([dst_ptrs, src_ptrs, sizes], axis=1).astype(np.int64, copy=False)
        _loop_copies(flat.ravel().tolist(), stream)
    else:
        raise ValueError("DmaMode.TORCH copies tensors, not raw pointers: use the torch path")


def _spread(
    dst_ptrs: np.ndarray,
    src_ptrs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
    streams: int,
    share: Callable[[np.ndarray, np.ndarray, np.ndarray, torch.cuda.Stream], None],
) -> bool:
    """Whether the list is dealt with here: True when it is empty, or when it fans out (then fork,
    `share` each stream's contiguous part on it and join); refuses the legacy default stream."""
    if not len(sizes):
        return True
    _own_stream(stream)
    if not fans_out(len(sizes), streams):
        return False
    fan = _fan_out(stream, streams)
    bounds = _shares(sizes, streams)
    fan.fork()
    for st, lo, hi in zip(fan.streams, bounds, bounds[1:], strict=False):
        share(dst_ptrs[lo:hi], src_ptrs[lo:hi], sizes[lo:hi], st)
    fan.join()
    return True


def _own_stream(stream: torch.cuda.Stream) -> None:
    """Refuse the legacy default stream (the batch call rejects it, and it would serialise the device)."""
    if stream.cuda_stream == 0:
        raise ValueError("batched copies need a stream you created, not the legacy default stream")


def fans_out(n: int, streams: int) -> bool:
    """Whether `n` copies asked to use `streams` streams are spread over them (two or more each)."""
    return streams > 1 and n >= 2 * streams


def _shares(sizes: np.ndarray, streams: int) -> list[int]:
    """Bounds of `streams` contiguous shares of about equal bytes (not counts: runs after churn
    differ widely in length): `[0, cut, ..., len(sizes)]`."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, streams) / streams, side="right")
    return [0, *cuts.tolist(), len(sizes)]


# The runtime's own cudaMemcpyBatchAsync, called with the arrays' memory (no conversion of
# Python ints): on an H200 host 0.5 us per copy against 1.4 us through cuda.bindings, whose
# list arguments made a 2048-run layer cost 2.9 ms of submission, more than its transfer.
_direct: Callable[[np.ndarray, np.ndarray, np.ndarray, int], None] | None = None
_direct_probed = False


def _direct_batch() -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], None] | None:
    """`call(dst, src, sizes, stream handle)` through the loaded libcudart, or None where unusable."""
    global _direct, _direct_probed
    if not _direct_probed:
        _direct_probed = True
        try:
            _direct = _load_direct()
        except (OSError, AttributeError, ValueError) as e:
            log.info("direct cudaMemcpyBatchAsync unavailable (%s); using cuda.bindings", e)
    return _direct


def _load_direct() -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], None] | None:
    found = direct_batch_fn()
    if found is None:
        return None
    fn, attrs = found
    first = (ctypes.c_size_t * 1)(0)

    def call(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        d, s_, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes))
        err = fn(d.ctypes.data, s_.ctypes.data, n.ctypes.data, len(n), attrs, first, 1, stream)
        cudart.check(err, "cudaMemcpyBatchAsync")

    return call


def direct_batch_fn() -> tuple[Callable[..., int], int] | None:
    """The loaded runtime's `cudaMemcpyBatchAsync` (typed) and the address of our copy attributes.

    None unless `cuda.bindings` made the attributes and the runtime is CUDA 13 (12.8
    and 12.9 take a `failIdx` argument too: other runtimes keep the bindings, whose
    argument conversion is slower but checked).
    """
    if _probe() is not DmaMode.BATCH or _attrs is None or not hasattr(_attrs, "getPtr"):
        return None
    rt = cudart.runtime()
    if rt is None or rt.version // 1000 != 13:
        return None
    fn = rt.lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, ptr]
    log.info("batched DMA through %s (runtime %d)", rt.path, rt.version)
    return fn, _attrs.getPtr()


def _loop_copies(flat: list[int], stream: torch.cuda.Stream) -> None:
    """One `cudaMemcpyAsync` per `(dst, src, bytes)` triple of `flat` on `stream`.

    Through the loaded runtime where found (`cudart`), else through `cuda.bindings`.
    """
    rt = cudart.runtime()
    if rt is not None:
        raw, handle = rt.memcpy_async, stream.cuda_stream
        kind_default = cudart.MEMCPY_DEFAULT
        for i in range(0, len(flat), 3):
            err = raw(flat[i], flat[i + 1], flat[i + 2], kind_default, handle)
            if err:
                cudart.check(err, "cudaMemcpyAsync")
        return
    memcpy = _runtime.cudaMemcpyAsync
    kind = _runtime.cudaMemcpyKind.cudaMemcpyDefault
    bound = _handle(stream)
    ok = _runtime.cudaError_t.cudaSuccess
    for i in range(0, len(flat), 3):
        (err,) = memcpy(flat[i], flat[i + 1], flat[i + 2], kind, bound)
        if err != ok:
            _check(err, "cudaMemcpyAsync")


class _FanOut:
    """A stream and `k - 1` side streams that fork from it and join back into it (events reused)."""

    def __init__(self, stream: torch.cuda.Stream, k: int) -> None:
        self.main = stream
        side = [torch.cuda.Stream(device=stream.device, priority=stream.priority) for _ in range(k - 1)]
        self.streams = [stream, *side]
        self.forked = torch.cuda.Event()
        self.joined = [torch.cuda.Event() for _ in side]

    def fork(self) -> None:
        """Side streams start after everything queued on the main stream so far."""
        self.forked.record(self.main)
        for st in self.streams[1:]:
            st.wait_event(self.forked)

    def join(self) -> None:
        """Work queued on the main stream from now on waits for every side stream."""
        for st, ev in zip(self.streams[1:], self.joined, strict=True):
            ev.record(st)
            self.main.wait_event(ev)


# Recording an event again is safe: a wait takes the event's state when it is enqueued.
_fans: dict[tuple[int, int], _FanOut] = {}


def _fan_out(stream: torch.cuda.Stream, k: int) -> _FanOut:
    """The fan-out of `k` streams for `stream`, made once (so its side streams are its own)."""
    key = (stream.cuda_stream, k)
    fan = _fans.get(key)
    if fan is None:
        fan = _fans[key] = _FanOut(stream, k)
    return fan


_handles: dict[int, object] = {}


def _handle(stream: torch.cuda.Stream):
    """The bindings' handle for a torch stream, made once per stream."""
    h = _handles.get(stream.cuda_stream)
    if h is None:
        h = _handles[stream.cuda_stream] = _runtime.cudaStream_t(stream.cuda_stream)
    return h


def _check(err, what: str) -> None:
    if err != _runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err}")
