"""The CUDA runtime this process already uses, called through ctypes on the hot paths.

Through a bindings package and torch most of a runtime call's host cost is argument conversion and
wrappers (bench/FINDINGS.md). Here the functions of the `libcudart` torch loaded are called with raw
integers; `runtime()` is None where it cannot be found (no CUDA, a static runtime). Every
once-per-process finding of this package (`RUNTIME`, `dma.RUNTIME`, `native.LIBRARY`) is a
`Probed`: a test pins a stand-in with `set`, `reset` forgets it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.errors import CudaRuntimeError

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


@dataclass(frozen=True)
class Runtime:
    """Typed entry points of the loaded `libcudart` and its version (e.g. 13000)."""

    lib: ctypes.CDLL
    path: str
    version: int

    def __post_init__(self) -> None:
        ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
        self.lib.cudaMemcpyAsync.argtypes = [ptr, ptr, size_t, ctypes.c_int, ptr]
        self.lib.cudaEventRecord.argtypes = [ptr, ptr]
        self.lib.cudaStreamWaitEvent.argtypes = [ptr, ptr, ctypes.c_uint]
        for fn in (self.lib.cudaMemcpyAsync, self.lib.cudaEventRecord, self.lib.cudaStreamWaitEvent):
            fn.restype = ctypes.c_int

    @property
    def memcpy_async(self):
        """`(dst, src, bytes, kind, stream handle) -> error code`."""
        return self.lib.cudaMemcpyAsync

    @property
    def event_record(self):
        """`(event handle, stream handle) -> error code`."""
        return self.lib.cudaEventRecord

    @property
    def stream_wait_event(self):
        """`(stream handle, event handle, flags) -> error code`."""
        return self.lib.cudaStreamWaitEvent


def _find() -> Runtime | None:
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({ln.split()[-1] for ln in fh.read().splitlines() if "/libcudart.so" in ln})
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
        with open("/proc/self/maps") as fh:
            paths = sorted({ln.split()[-1] for ln in fh.read().splitlines() if "/libcuda.so" in ln})
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
