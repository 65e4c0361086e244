"""Copy-engine transfers of many runs at once (`copy_runs`).

One `cudaMemcpyBatchAsync` (CUDA 13 runtime) submits every run of a layer in one call, on the
arrays' memory; with an older runtime in the process, a loop of `cudaMemcpyAsync`; without CUDA, no
raw copies (`DmaMode.TORCH`). Both are the process's own `libcudart` called through ctypes
(`cudart`): no bindings package. The legacy default stream is refused (the batch call rejects it).
Fanning copies out over several streams is the compiled loop's (`loop`, `native`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable
from enum import Enum

import numpy as np
import torch

from kvtier.errors import BackendUnavailableError, TransferError
from kvtier.transfer import cudart

log = logging.getLogger(__name__)


class DmaMode(str, Enum):
    """Which host API submits a list of copies."""

    BATCH = "batch"  # one cudaMemcpyBatchAsync per call
    LOOP = "loop"  # one cudaMemcpyAsync per run
    TORCH = "torch"  # no raw copies (no CUDA runtime found): callers copy tensors


# Up to this many copies go out as plain `cudaMemcpyAsync` calls: one where the batch call exists
# (bench/FINDINGS.md), a few where the loop is all there is (the compiled loop's threshold).
SMALL_BATCH = 4
SMALL_BATCH_DIRECT = 1


class _Location(ctypes.Structure):  # cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CopyAttributes(ctypes.Structure):
    """`cudaMemcpyAttributes` as CUDA 13's runtime header lays it out."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _Location),
        ("dst_loc_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


# Sources are read in stream order (cudaMemcpySrcAccessOrderStream = 1); the copies run beside the
# model's kernels, so ask the driver to favour overlap (cudaMemcpyFlagPreferOverlapWithCompute = 1).
# Made once and never freed: the compiled loop keeps its address.
ATTRIBUTES = CopyAttributes(src_access_order=1, flags=1)

# `call(dst, src, sizes, stream handle)`: the runtime's batch call on `[n]` int64 arrays.
DirectBatch = Callable[[np.ndarray, np.ndarray, np.ndarray, int], None]


@dataclasses.dataclass(frozen=True)
class DmaRuntime:
    """How this process submits lists of copies; `small_batch`, a pinned `small_batch()` (tests)."""

    mode: DmaMode
    small_batch: int | None = None


def _find() -> DmaRuntime:
    """The best mode of this process."""
    if not torch.cuda.is_available() or cudart.runtime() is None:
        mode = DmaMode.TORCH
    else:
        mode = DmaMode.BATCH if direct_batch_fn() is not None else DmaMode.LOOP
    log.info("batched DMA mode: %s", mode.value)
    return DmaRuntime(mode)


RUNTIME: cudart.Probed[DmaRuntime] = cudart.Probed(_find)


def dma_mode() -> DmaMode:
    """The mode `copy_runs` uses on this machine (`TORCH` without CUDA)."""
    return RUNTIME.get().mode


def small_batch() -> int:
    """Copies up to which a list goes out as plain `cudaMemcpyAsync` calls, not one batch."""
    rt = RUNTIME.get()
    if rt.small_batch is not None:
        return rt.small_batch
    return SMALL_BATCH_DIRECT if rt.mode is DmaMode.BATCH and DIRECT.get() is not None else SMALL_BATCH


def copy_runs(
    dst_ptrs: np.ndarray,
    src_ptrs: np.ndarray,
    sizes: np.ndarray,
    stream: torch.cuda.Stream,
) -> None:
    """Copy `sizes[i]` bytes from `src_ptrs[i]` to `dst_ptrs[i]` for every i, on `stream`.

    `dst_ptrs`, `src_ptrs`, `sizes`: `[n]` uint64/int64 numpy arrays of raw addresses (pinned
    host or device memory) and byte counts; copies of one call must not overlap.
    """
    if not len(sizes):
        return
    if stream.cuda_stream == 0:  # the batch call rejects it, and it would serialise the device
        raise TransferError("batched copies need a stream you created, not the legacy default stream")
    mode = RUNTIME.get().mode
    if mode is DmaMode.TORCH:
        raise BackendUnavailableError("raw copies need the CUDA runtime; this process copies tensors")
    direct = DIRECT.get()
    if mode is DmaMode.BATCH and direct is not None and len(sizes) > small_batch():
        direct(dst_ptrs, src_ptrs, sizes, stream.cuda_stream)
        return
    # A few plain calls cost less than building one batch.
    flat = np.stack([dst_ptrs, src_ptrs, sizes], axis=1).astype(np.int64, copy=False)
    _loop_copies(flat.ravel().tolist(), stream)


def _find_direct() -> DirectBatch | None:
    """The runtime's own batch call, wrapped; None where unusable."""
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


# The runtime's own cudaMemcpyBatchAsync, called with the arrays' memory, found on first use.
DIRECT: cudart.Probed[DirectBatch | None] = cudart.Probed(_find_direct)


def direct_batch_fn() -> tuple[Callable[..., int], int] | None:
    """The loaded runtime's `cudaMemcpyBatchAsync` (typed) and the address of `ATTRIBUTES`; None
    unless the runtime is CUDA 13 (12.8 and 12.9 take a `failIdx` argument too: they loop)."""
    rt = cudart.runtime()
    if rt is None or rt.version // 1000 != 13 or not hasattr(rt.lib, "cudaMemcpyBatchAsync"):
        return None
    fn = rt.lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, ptr]
    return fn, ctypes.addressof(ATTRIBUTES)


def _loop_copies(flat: list[int], stream: torch.cuda.Stream) -> None:
    """One `cudaMemcpyAsync` per `(dst, src, bytes)` triple of `flat` on `stream`."""
    rt = cudart.runtime()
    if rt is None:
        raise BackendUnavailableError("raw copies need the CUDA runtime; this process copies tensors")
    raw, handle, kind_default = rt.memcpy_async, stream.cuda_stream, cudart.MEMCPY_DEFAULT
    for i in range(0, len(flat), 3):
        err = raw(flat[i], flat[i + 1], flat[i + 2], kind_default, handle)
        if err:
            cudart.check(err, "cudaMemcpyAsync")
