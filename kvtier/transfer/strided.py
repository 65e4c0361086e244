"""Strided 2-D copy-engine copies (`cudaMemcpy2DAsync`): `height` lines of `width` bytes, each side at
its own pitch, in one call. In `page_first` a contiguous run of pages holds one layer's rows as
lines a page's rows of every layer apart, so such a run moves in one call per buffer and layer.
"""

from __future__ import annotations

import ctypes

import torch

from kvtier.errors import BackendUnavailableError
from kvtier.transfer import cudart

# The calibration times lines at a host pitch of this many lines (a layer's share of a page_first page).
PITCH_LINES = 64


def _fn():
    rt = cudart.runtime()
    if rt is None:
        raise BackendUnavailableError("strided copies need the process's libcudart (a CUDA build of torch)")
    fn = rt.lib.cudaMemcpy2DAsync
    ptr, size_t = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [ptr, size_t, ptr, size_t, size_t, size_t, ctypes.c_int, ptr]
    fn.restype = ctypes.c_int
    return fn


def copy_2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: torch.cuda.Stream
) -> None:
    """`height` lines of `width` bytes from `src` (lines `spitch` apart) to `dst` (`dpitch` apart),
    on `stream`, through the copy engine; raises `CudaRuntimeError` on a runtime error."""
    if height <= 0:
        return
    err = _fn()(dst, dpitch, src, spitch, width, height, cudart.MEMCPY_DEFAULT, stream.cuda_stream)
    cudart.check(err, f"cudaMemcpy2DAsync of {height} lines of {width} bytes")
