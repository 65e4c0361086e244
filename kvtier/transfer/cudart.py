"""The CUDA runtime this process already uses, called through ctypes on the hot paths.

A reload submits two runtime calls per model layer (a copy and an event record). On the
H200 host the driver's own work for the pair is ~3 us (measured in C); from Python
through `cuda.bindings` and torch the pair took 6-9 us (profiled), the rest being
argument conversion, result objects and torch's event wrapper. Here the same functions of the
`libcudart` that torch loaded (found by its mapping in the process, so there is one
runtime and one context) are called with raw integers.

`runtime()` is None where that library cannot be found (no CUDA, another platform, a
statically linked runtime): callers then keep `cuda.bindings` or torch.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

from kvtier.errors import CudaRuntimeError

log = logging.getLogger(__name__)

# cudaMemcpyKind: the runtime infers the direction from the pointers (unified addressing).
MEMCPY_DEFAULT = 4


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


_runtime: Runtime | None = None
_probed = False


def runtime() -> Runtime | None:
    """The process's `libcudart`, loaded once; None where it is not mapped (see the module docstring)."""
    global _runtime, _probed
    if not _probed:
        _probed = True
        try:
            _runtime = _load()
        except (OSError, AttributeError) as e:
            log.info("raw CUDA runtime calls unavailable (%s)", e)
    return _runtime


def _load() -> Runtime | None:
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


def check(err: int, what: str) -> None:
    """Raise `CudaRuntimeError` for a non-zero runtime error code."""
    if err:
        raise CudaRuntimeError(f"{what} failed: CUDA error {err}")
