"""Triton, optional, for kvtier's kernels (the transfer's row kernel, the engine's paged attention).

Without Triton `triton` and `tl` are None and no kernel runs (`runs_on`). Triton reads
`TRITON_INTERPRET` when it wraps a function, so kernels are wrapped on first use, not at import,
and again when the interpreter is switched on or off (`ModeJit`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

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


def runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run here with its tensors on `device` (CUDA, or the interpreter)."""
    return triton is not None and (device.type == "cuda" or interpreting())


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


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def launch_on(device: torch.device, kernel: Any, programs: int, args: tuple, kwargs: dict[str, Any]) -> None:
    """Launch `kernel` over a grid of `programs` on the current stream of `device` (or the interpreter)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(programs,)](*args, **kwargs)
