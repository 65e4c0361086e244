"""Triton, optional: its import, the CPU interpreter switch, and kernels wrapped for the current mode.

Without Triton `triton` and `tl` are None, and the kernels refuse to run
(`BackendUnavailableError`). Triton reads `TRITON_INTERPRET` when it wraps a function,
so kernels are wrapped on first use, not at import, and again if the interpreter is
switched on or off (`ModeJit`).
"""

from __future__ import annotations

import os
from typing import Any

try:  # Triton is optional: without it the kernels raise and `kernels.triton_available()` is False.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class ModeJit:
    """`triton.jit(fn, **options)` for the current mode, wrapped again when the mode changes."""

    def __init__(self, fn: Any, **options: Any) -> None:
        self.fn, self.options = fn, options
        self.jit: Any = None
        self.mode: bool | None = None

    def __call__(self) -> Any:
        mode = interpreting()
        if self.jit is None or self.mode != mode:
            self.jit, self.mode = triton.jit(self.fn, **self.options), mode
        return self.jit
