"""The CUDA runtime this process already uses, called through ctypes on the hot paths, and the
copy engine's transfers of many runs at once (`copy_runs`).

Through bindings and torch most of a runtime call's host cost is argument conversion (bench/
FINDINGS.md): here the `libcudart` torch loaded is called with raw integers (`runtime()`: None
without CUDA or with a static runtime). `copy_runs`: one `cudaMemcpyBatchAsync` (CUDA 13) a layer,
else a loop of `cudaMemcpyAsync`, else no raw copies (`DmaMode.TORCH`); never on the legacy default
stream. Once-per-process findings (`RUNTIME`, `DMA`, `DRIVER`, `native.LIBRARY`) are `Probed`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable
from enum import Enum
from typing import Generic, TypeVar

import numpy as np
import torch

from kvtier.errors import BackendUnavailableError, CudaRuntimeError, TransferError

log = logging.getLogger(__name__)

# cudaMemcpyKind: the runtime infers the direction from the pointers (unified addressing).
MEMCPY_DEFAULT = 4

T = TypeVar("T")


class Probed(Generic[T]):
    """A value found once per process with `find` on the first `get()`; `set(value)` pins one
    instead (None: absent), `reset()` forgets it."""

    def __init__(self, find: Callable[[], T]) -> None:
        self._find = find
        self._value: T | None = None
        self._found = False

    def get(self) -> T:
        if not self._found:
            self._value, self._found = self._find(), True
        return self._value  # type: ignore[return-value]

    def set(self, value: T) -> None:
        self._value, self._found = value, True

    def reset(self) -> None:
        self._value, self._found = None, False


class Runtime:
    """Typed entry points of the loaded `libcudart` at `path`, and its `version` (e.g. 13000):
    `memcpy_async(dst, src, bytes, kind, stream)`, `event_record(event, stream)` and
    `stream_wait_event(stream, event, flags)`, `set_device(index)`, each returning the runtime's error
    code."""

    def __init__(self, lib: ctypes.CDLL, path: str, version: int) -> None:
        self.lib, self.path, self.version = lib, path, version
        ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
        self.memcpy_async = lib.cudaMemcpyAsync
        self.memcpy_async.argtypes = [ptr, ptr, size_t, ctypes.c_int, ptr]
        self.event_record = lib.cudaEventRecord
        self.event_record.argtypes = [ptr, ptr]
        self.stream_wait_event = lib.cudaStreamWaitEvent
        self.stream_wait_event.argtypes = [ptr, ptr, ctypes.c_uint]
        self.set_device = lib.cudaSetDevice
        self.set_device.argtypes = [ctypes.c_int]
        for fn in (self.memcpy_async, self.event_record, self.stream_wait_event, self.set_device):
            fn.restype = ctypes.c_int


def _mapped(name: str) -> list[str]:
    """Paths of the libraries named `name` (`/libcudart.so`, say) that this process has mapped."""
    with open("/proc/self/maps") as fh:
        return sorted({ln.split()[-1] for ln in fh.read().splitlines() if name in ln})


def _find() -> Runtime | None:
    try:
        paths = _mapped("/libcudart.so")
        if not paths:
            return None
        lib = ctypes.CDLL(paths[0])
        version = ctypes.c_int()
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return None
        log.info("raw CUDA runtime calls through %s (runtime %d)", paths[0], version.value)
        return Runtime(lib, paths[0], version.value)
    except (OSError, AttributeError) as e:
        log.info("raw CUDA runtime calls unavailable (%s)", e)
        return None


RUNTIME: Probed[Runtime | None] = Probed(_find)


def runtime() -> Runtime | None:
    """The process's `libcudart`, loaded once; None where it is not mapped (see the module docstring)."""
    return RUNTIME.get()


class Driver:
    """The CUDA driver library the process has mapped: `cuLaunchKernel` for the compiled loop, and
    `param_sizes` to check a kernel's parameters before the loop launches it."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, size_t, uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        self.launch_kernel = lib.cuLaunchKernel
        self.launch_kernel.argtypes = [ptr, uint, uint, uint, uint, uint, uint, uint, ptr, ptr, ptr]
        self._param_info = lib.cuFuncGetParamInfo
        self._param_info.argtypes = [ptr, size_t, ctypes.POINTER(size_t), ctypes.POINTER(size_t)]
        for fn in (self.launch_kernel, self._param_info):
            fn.restype = ctypes.c_int

    def param_sizes(self, func: int, most: int = 32) -> list[int]:
        """Bytes of each parameter of kernel `func` (a `CUfunction`), in order."""
        offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
        while len(sizes) < most and not self._param_info(func, len(sizes), offset, size):
            sizes.append(size.value)
        return sizes


def _find_driver() -> Driver | None:
    try:
        paths = _mapped("/libcuda.so")
        return Driver(ctypes.CDLL(paths[0])) if paths else None
    except (OSError, AttributeError) as e:  # no cuFuncGetParamInfo: a driver older than CUDA 12.4
        log.info("kernel launches from the compiled loop unavailable (%s)", e)
        return None


DRIVER: Probed[Driver | None] = Probed(_find_driver)


def driver() -> Driver | None:
    """The process's CUDA driver library, once it is mapped (after CUDA is initialised), else None."""
    return DRIVER.get()


def check(err: int, what: str) -> None:
    """Raise `CudaRuntimeError` for a non-zero runtime error code."""
    if err:
        raise CudaRuntimeError(f"{what} failed: CUDA error {err}")


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
    """How this process submits lists of copies: `mode`; `direct`, the runtime's batch call on the
    arrays' memory (`BATCH` only); `small_batch`, a pinned `small_batch()` (tests)."""

    mode: DmaMode
    direct: DirectBatch | None = None
    small_batch: int | None = None


def _find_dma() -> DmaRuntime:
    """The best mode of this process."""
    found = direct_batch_fn() if torch.cuda.is_available() else None
    if found is None:
        rt = DmaRuntime(
            DmaMode.LOOP if torch.cuda.is_available() and runtime() is not None else DmaMode.TORCH
        )
    else:
        fn, attrs = found
        first = (ctypes.c_size_t * 1)(0)

        def direct(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
            d, s_, n = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, sizes))
            check(
                fn(d.ctypes.data, s_.ctypes.data, n.ctypes.data, len(n), attrs, first, 1, stream),
                "cudaMemcpyBatchAsync",
            )

        rt = DmaRuntime(DmaMode.BATCH, direct)
    log.info("batched DMA mode: %s", rt.mode.value)
    return rt


DMA: Probed[DmaRuntime] = Probed(_find_dma)


def dma_mode() -> DmaMode:
    """The mode `copy_runs` uses on this machine (`TORCH` without CUDA)."""
    return DMA.get().mode


def small_batch() -> int:
    """Copies up to which a list goes out as plain `cudaMemcpyAsync` calls, not one batch."""
    rt = DMA.get()
    if rt.small_batch is not None:
        return rt.small_batch
    return SMALL_BATCH_DIRECT if rt.direct is not None else SMALL_BATCH


def copy_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
    """Copy `sizes[i]` bytes from `src[i]` to `dst[i]` for every i, on `stream`: `[n]` uint64/int64
    numpy arrays of raw addresses (pinned host or device memory) and byte counts; copies of one call
    must not overlap."""
    if not len(sizes):
        return
    if stream.cuda_stream == 0:  # the batch call rejects it, and it would serialise the device
        raise TransferError("batched copies need a stream you created, not the legacy default stream")
    rt, raw = DMA.get(), runtime()
    if rt.mode is DmaMode.TORCH or raw is None:
        raise BackendUnavailableError("raw copies need the CUDA runtime; this process copies tensors")
    if rt.direct is not None and len(sizes) > small_batch():
        rt.direct(dst, src, sizes, stream.cuda_stream)
        return
    # A few plain calls cost less than building one batch.
    flat = np.stack([dst, src, sizes], axis=1).astype(np.int64, copy=False).ravel().tolist()
    copy, handle = raw.memcpy_async, stream.cuda_stream
    for i in range(0, len(flat), 3):
        check(copy(flat[i], flat[i + 1], flat[i + 2], MEMCPY_DEFAULT, handle), "cudaMemcpyAsync")


def direct_batch_fn() -> tuple[Callable[..., int], int] | None:
    """The loaded runtime's `cudaMemcpyBatchAsync` (typed) and the address of `ATTRIBUTES`; None
    unless the runtime is CUDA 13 (12.8 and 12.9 take a `failIdx` argument too: they loop)."""
    rt = runtime()
    if rt is None or rt.version // 1000 != 13 or not hasattr(rt.lib, "cudaMemcpyBatchAsync"):
        return None
    fn = rt.lib.cudaMemcpyBatchAsync
    fn.restype = ctypes.c_int
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ptr, ptr, ptr, size_t, ptr, ptr, size_t, ptr]
    return fn, ctypes.addressof(ATTRIBUTES)
