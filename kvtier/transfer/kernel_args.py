"""Triton, optional, and the host side of the row kernel: its wrapping, word widths and launch.

Without Triton `triton` and `tl` are None and the kernel does not run (`kernels.runs_on`). Triton
reads `TRITON_INTERPRET` when it wraps a function, so the kernel is wrapped on first use, not at
import, and again when the interpreter is switched on or off (`ModeJit`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class ModeJit:
    """`triton.jit(fn, **options)` for the current mode, wrapped again when the mode changes, with
    `helpers` (the Triton functions `fn` calls) bound in `fn`'s module as their names plus `_jit`."""

    def __init__(self, fn: Any, *helpers: Any, **options: Any) -> None:
        self.fn, self.helpers, self.options = fn, helpers, options
        self.jit: Any = None
        self.mode: bool | None = None

    def __call__(self) -> Any:
        mode = interpreting()
        if self.jit is None or self.mode != mode:
            for helper in self.helpers:
                self.fn.__globals__[f"{helper.__name__}_jit"] = triton.jit(helper)
            self.jit, self.mode = triton.jit(self.fn, **self.options), mode
        return self.jit


def word_size(row_bytes: int, aligns: list[int]) -> int:
    """The widest word size (8, 4, 2, 1) dividing `row_bytes` and every value of `aligns`."""
    bits = row_bytes
    for a in aligns:
        bits |= a
    for size in (8, 4, 2):
        if bits % size == 0:
            return size
    return 1


def common_alignment(*offsets: np.ndarray) -> int:
    """The largest power of two (up to 2**20) dividing every value of `offsets` (`[m]` int64 each)."""
    acc = 0
    for o in offsets:
        if len(o):
            acc |= int(np.bitwise_or.reduce(o))
    return acc & -acc if acc else 1 << 20


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def launch_on(device: torch.device, kernel: Any, programs: int, args: tuple, kwargs: dict[str, Any]) -> None:
    """Launch `kernel` over a grid of `programs` on the current stream of `device` (or the interpreter)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(programs,)](*args, **kwargs)
