"""Copy-engine transfers of many runs at once (`copy_runs`).

One `cudaMemcpyBatchAsync` (CUDA 12.8+) submits every run of a layer in one call: directly on the
arrays' memory with a CUDA 13 runtime in the process (`cudart`), else through `cuda.bindings`;
without the batch call, a loop of `cudaMemcpyAsync`; without `cuda.bindings`, no raw copies
(`DmaMode.TORCH`). `copy_runs(..., streams=k)` fans the list out over the caller's stream and
`k - 1` side streams forked from and joined into it, so several copy engines hide each other's
fixed cost per copy. The legacy default stream is refused (the batch call rejects it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np
import torch

from kvtier.errors import BackendUnavailableError, CudaRuntimeError, TransferError
from kvtier.transfer import cudart

log = logging.getLogger(__name__)


class DmaMode(str, Enum):
    """Which host API submits a list of copies."""

    BATCH = "batch"  # one cudaMemcpyBatchAsync per call
    LOOP = "loop"  # one cudaMemcpyAsync per run
    TORCH = "torch"  # no raw copies (no CUDA or no cuda.bindings): callers copy tensors


# Up to this many copies go out as plain `cudaMemcpyAsync` calls even where batching exists:
# through `cuda.bindings`, and through the runtime's batch call made directly (bench/FINDINGS.md).
SMALL_BATCH = 4
SMALL_BATCH_DIRECT = 1

# `call(dst, src, sizes, stream handle)`: the runtime's batch call on `[n]` int64 arrays.
DirectBatch = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]


@dataclasses.dataclass(frozen=True)
class DmaRuntime:
    """How this process submits lists of copies: `bindings`, the `cuda.bindings.runtime` module;
    `attrs`, the batch call's copy attributes; `small_batch`, a pinned `small_batch()` (tests)."""

    mode: DmaMode
    bindings: Any = None
    attrs: Any = None
    small_batch: int | None = None


def _find() -> DmaRuntime:
    """The best mode of this process."""
    if not torch.cuda.is_available():
        return DmaRuntime(DmaMode.TORCH)
    try:
        from cuda.bindings import runtime
    except ImportError:
        log.info("batched DMA mode: %s (no cuda.bindings)", DmaMode.TORCH.value)
        return DmaRuntime(DmaMode.TORCH)
    if not (hasattr(runtime, "cudaMemcpyBatchAsync") and hasattr(runtime, "cudaMemcpyAttributes")):
        log.info("batched DMA mode: %s", DmaMode.LOOP.value)
        return DmaRuntime(DmaMode.LOOP, runtime)
    log.info("batched DMA mode: %s", DmaMode.BATCH.value)
    return DmaRuntime(DmaMode.BATCH, runtime, _copy_attributes(runtime))


@functools.cache
def _copy_attributes(runtime: Any) -> Any:
    """The batch call's copy attributes, made once and never freed: the direct batch call and the
    compiled loop keep their address, however often `RUNTIME` is found again."""
    attrs = runtime.cudaMemcpyAttributes()
    attrs.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    # The copies run beside the model's kernels; ask the driver to favour overlap.
    attrs.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
    return attrs


RUNTIME: cudart.Probed[DmaRuntime] = cudart.Probed(_find)


def dma_mode() -> DmaMode:
    """The mode `copy_runs` uses on this machine (`TORCH` without CUDA)."""
    return RUNTIME.get().mode


def small_batch() -> int:
    """Copies up to which a list goes out as plain `cudaMemcpyAsync` calls, not one batch."""
    rt = RUNTIME.get()
    if rt.small_batch is not None:
        return rt.small_batch
    if rt.mode is not DmaMode.BATCH:
        return SMALL_BATCH
    return SMALL_BATCH_DIRECT if DIRECT.get() is not None else SMALL_BATCH


def copy_runs(
    dst_ptrs: np.ndarray,
    src_ptrs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
    streams: int = 1,
) -> None:
    """Copy `sizes[i]` bytes from `src_ptrs[i]` to `dst_ptrs[i]` for every i, on `stream`.

    `dst_ptrs`, `src_ptrs`, `sizes`: `[n]` uint64/int64 numpy arrays of raw addresses (pinned
    host or device memory) and byte counts; copies of one call must not overlap. `streams` >
    1: fanned out in contiguous shares of about equal bytes (`fans_out`, `shares`).
    """
    if not len(sizes):
        return
    if stream.cuda_stream == 0:  # the batch call rejects it, and it would serialise the device
        raise TransferError("batched copies need a stream you created, not the legacy default stream")
    if fans_out(len(sizes), streams):
        fan = _fan_out(stream, streams)
        bounds = shares(sizes, streams)
        fan.fork()
        for st, lo, hi in zip(fan.streams, bounds, bounds[1:], strict=False):
            copy_runs(dst_ptrs[lo:hi], src_ptrs[lo:hi], sizes[lo:hi], st)
        fan.join()
        return
    rt = RUNTIME.get()
    mode = rt.mode
    if mode is DmaMode.BATCH and len(sizes) <= small_batch():
        mode = DmaMode.LOOP  # a few plain calls cost less than building one batch
    if mode is DmaMode.BATCH:
        _batch(rt, dst_ptrs, src_ptrs, sizes, stream)
    elif mode is DmaMode.LOOP:
        flat = np.stack([dst_ptrs, src_ptrs, sizes], axis=1).astype(np.int64, copy=False)
        _loop_copies(rt, flat.ravel().tolist(), stream)
    else:
        raise BackendUnavailableError("raw copies need CUDA and cuda.bindings; this process copies tensors")


def _batch(rt: DmaRuntime, dst_ptrs: np.ndarray, src_ptrs: np.ndarray, sizes: np.ndarray, stream) -> None:
    """One batched call: the runtime's own where found, else through the bindings."""
    direct = DIRECT.get()
    if direct is not None:
        direct(dst_ptrs, src_ptrs, sizes, stream.cuda_stream)
        return
    try:
        lists = (dst_ptrs.tolist(), src_ptrs.tolist(), sizes.tolist())
        err, *_ = rt.bindings.cudaMemcpyBatchAsync(
            *lists, len(sizes), [rt.attrs], [0], 1, _handle(rt, stream)
        )
    except TypeError as e:
        # Bindings of another CUDA release take other arguments: use the loop from now on.
        log.warning("cudaMemcpyBatchAsync not usable through these bindings (%s); looping instead", e)
        RUNTIME.set(dataclasses.replace(rt, mode=DmaMode.LOOP))
        copy_runs(dst_ptrs, src_ptrs, sizes, stream)
        return
    _check(rt, err, "cudaMemcpyBatchAsync")


def fans_out(n: int, streams: int) -> bool:
    """Whether `n` copies asked to use `streams` streams are spread over them (two or more each)."""
    return streams > 1 and n >= 2 * streams


def shares(sizes: np.ndarray, streams: int) -> list[int]:
    """Bounds of `streams` contiguous shares of about equal bytes (not counts: runs after churn
    differ widely in length): `[0, cut, ..., len(sizes)]`; a share may be empty."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, streams) / streams, side="right")
    return [0, *cuts.tolist(), len(sizes)]


def _find_direct() -> DirectBatch | None:
    """The runtime's own batch call, wrapped; None where unusable."""
    try:
        found = direct_batch_fn()
    except (OSError, AttributeError, ValueError) as e:
        log.info("direct cudaMemcpyBatchAsync unavailable (%s); using cuda.bindings", e)
        return None
    if found is None:
        return None
    fn, attrs = found
    first = (ctypes.c_size_t * 1)(0)

    def call(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        d, s_, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes))
        err = fn(d.ctypes.data, s_.ctypes.data, n.ctypes.data, len(n), attrs, first, 1, stream)
        cudart.check(err, "cudaMemcpyBatchAsync")

    return call


# The runtime's own cudaMemcpyBatchAsync, called with the arrays' memory (no conversion of
# Python ints), found on first use.
DIRECT: cudart.Probed[DirectBatch | None] = cudart.Probed(_find_direct)


def direct_batch_fn() -> tuple[Callable[..., int], int] | None:
    """The loaded runtime's `cudaMemcpyBatchAsync` (typed) and the address of our copy attributes;
    None unless `cuda.bindings` made the attributes and the runtime is CUDA 13 (12.8 and 12.9
    take a `failIdx` argument too: they keep the bindings, slower but checked)."""
    dma = RUNTIME.get()
    if dma.mode is not DmaMode.BATCH or dma.attrs is None or not hasattr(dma.attrs, "getPtr"):
        return None
    rt = cudart.runtime()
    if rt is None or rt.version // 1000 != 13:
        return None
    fn = rt.lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, ptr]
    log.info("batched DMA through %s (runtime %d)", rt.path, rt.version)
    return fn, dma.attrs.getPtr()


def _loop_copies(dma: DmaRuntime, flat: list[int], stream: torch.cuda.Stream) -> None:
    """One `cudaMemcpyAsync` per `(dst, src, bytes)` triple of `flat` on `stream`: through the loaded
    runtime where found (`cudart`), else through `cuda.bindings`."""
    rt = cudart.runtime()
    if rt is not None:
        raw, handle, kind_default = rt.memcpy_async, stream.cuda_stream, cudart.MEMCPY_DEFAULT
        for i in range(0, len(flat), 3):
            err = raw(flat[i], flat[i + 1], flat[i + 2], kind_default, handle)
            if err:
                cudart.check(err, "cudaMemcpyAsync")
        return
    bindings = dma.bindings
    memcpy, kind = bindings.cudaMemcpyAsync, bindings.cudaMemcpyKind.cudaMemcpyDefault
    bound, ok = _handle(dma, stream), bindings.cudaError_t.cudaSuccess
    for i in range(0, len(flat), 3):
        (err,) = memcpy(flat[i], flat[i + 1], flat[i + 2], kind, bound)
        if err != ok:
            _check(dma, err, "cudaMemcpyAsync")


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


# Per stream, made once and kept: a fan-out's side streams are its own; re-recording its events is safe.
_fans: dict[tuple[int, int], _FanOut] = {}
_handles: dict[int, object] = {}


def _fan_out(stream: torch.cuda.Stream, k: int) -> _FanOut:
    """The fan-out of `k` streams for `stream`, made once."""
    key = (stream.cuda_stream, k)
    fan = _fans.get(key)
    if fan is None:
        fan = _fans[key] = _FanOut(stream, k)
    return fan


def _handle(dma: DmaRuntime, stream: torch.cuda.Stream):
    """The bindings' handle for a torch stream, made once per stream."""
    h = _handles.get(stream.cuda_stream)
    if h is None:
        h = _handles[stream.cuda_stream] = dma.bindings.cudaStream_t(stream.cuda_stream)
    return h


def _check(dma: DmaRuntime, err, what: str) -> None:
    if err != dma.bindings.cudaError_t.cudaSuccess:
        raise CudaRuntimeError(f"{what} failed: {err}")
