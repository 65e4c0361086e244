"""Triton, optional, and the host side the two kernels share: argument checks, placement and launch.

Without Triton `triton` and `tl` are None and the kernels refuse to run
(`BackendUnavailableError`). Triton reads `TRITON_INTERPRET` when it wraps a function, so
kernels are wrapped on first use, not at import, and again when the interpreter is switched
on or off (`ModeJit`).

Every check runs on the host before a launch, so a refused call writes nothing: words
tensors and offsets (`TransferError`), counts (`ConfigError`), a backend (Triton, and CUDA
or the interpreter: `BackendUnavailableError`) and, with `validate`, every row in bounds and
destination rows disjoint (`TransferError`; these read the offsets, so need them on the CPU).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import torch

from kvtier.errors import BackendUnavailableError, ConfigError, TransferError
from kvtier.pool.rows import WORD_DTYPES

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

WORD_SIZES: dict[torch.dtype, int] = {dtype: size for size, dtype in WORD_DTYPES.items()}


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


def check_words(t: torch.Tensor, name: str) -> None:
    """`t` is a 1-D contiguous words tensor (int64, int32, int16 or uint8)."""
    if not isinstance(t, torch.Tensor):
        raise TransferError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in WORD_SIZES:
        raise TransferError(f"{name} must be a words tensor (int64, int32, int16 or uint8), got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise TransferError(
            f"{name} must be 1-D and contiguous, got shape {tuple(t.shape)} stride {t.stride()}"
        )


def check_count(name: str, value: Any, *, least: int = 1, optional: bool = False) -> None:
    """`value` is an int (not a bool) of at least `least` (1 or 0), or None where `optional`."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        kind = "a positive int" if least == 1 else "a non-negative int"
        raise ConfigError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")


def check_offsets(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str], what: str) -> int:
    """The two offset tensors of one call: `[n]` int64 each, on one device; returns `n`."""
    for t, name in zip((a, b), names, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TransferError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype != torch.int64:
            raise TransferError(f"{name} must be 1-D int64, got shape {tuple(t.shape)} dtype {t.dtype}")
    if a.numel() != b.numel():
        raise TransferError(f"{names[0]} has {a.numel()} {what} but {names[1]} has {b.numel()}")
    if a.device != b.device:
        raise TransferError(f"offsets on different devices: {a.device} and {b.device}")
    return a.numel()


def validate_rows(offsets: torch.Tensor, row_words: int, numel: int, name: str) -> None:
    """Every row `[offset, offset + row_words)` lies inside `[0, numel)` (`offsets`: `[n]` int64 CPU)."""
    lo, hi = int(offsets.min()), int(offsets.max())
    if lo < 0 or hi + row_words > numel:
        bad = offsets[(offsets < 0) | (offsets + row_words > numel)]
        raise TransferError(
            f"{name}: rows of {row_words} words at offsets {bad[:8].tolist()}"
            f"{' ...' if bad.numel() > 8 else ''} fall outside a tensor of {numel} words"
        )


def validate_disjoint(offsets: torch.Tensor, row_words: int, name: str) -> None:
    """No two rows `[offset, offset + row_words)` overlap, repeated offsets included (`[n]` int64 CPU)."""
    if offsets.numel() < 2:
        return
    ordered = offsets.sort().values
    gaps = ordered[1:] - ordered[:-1]
    clash = torch.nonzero(gaps < row_words).flatten()
    if clash.numel():
        i = int(clash[0])
        a, b = int(ordered[i]), int(ordered[i + 1])
        what = "is repeated" if a == b else f"overlaps the row at {a}"
        raise TransferError(
            f"{name}: destination row at offset {b} {what} (rows of {row_words} words); "
            f"{clash.numel()} overlapping pair(s) in all"
        )


def host_offsets(validate: bool, offsets: torch.Tensor, call: str) -> bool:
    """Whether `offsets` are on the CPU; refuses `validate` with offsets on a GPU (reading them would
    wait for it)."""
    on_host = offsets.device.type == "cpu"
    if validate and not on_host:
        raise TransferError(
            f"{call}(validate=True) needs the offsets on the CPU (it would otherwise wait for the GPU); "
            f"they are on {offsets.device}. Validate the CPU indices before uploading them and pass "
            "validate=False."
        )
    return on_host


def word_size(row_bytes: int, aligns: list[int]) -> int:
    """The widest word size (8, 4, 2, 1) dividing `row_bytes` and every value of `aligns`."""
    bits = row_bytes
    for a in aligns:
        bits |= a
    for size in (8, 4, 2):
        if bits % size == 0:
            return size
    return 1


def rescale(offsets: torch.Tensor, from_size: int, to_size: int) -> torch.Tensor:
    """Word offsets in words of `from_size` bytes as words of `to_size` bytes."""
    if from_size == to_size:
        return offsets
    if from_size > to_size:
        return offsets * (from_size // to_size)
    return torch.div(offsets, to_size // from_size, rounding_mode="floor")


def common_alignment(*offsets: np.ndarray) -> int:
    """The largest power of two (up to 2**20) dividing every value of `offsets` (`[m]` int64 each)."""
    acc = 0
    for o in offsets:
        if len(o):
            acc |= int(np.bitwise_or.reduce(o))
    return acc & -acc if acc else 1 << 20


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def kernel_device(src: torch.Tensor, dst: torch.Tensor, call: str) -> torch.device:
    """The device a kernel over `src` and `dst` runs on: their GPU, or the CPU under the interpreter."""
    if triton is None:
        raise BackendUnavailableError(
            f"{call} needs Triton, which is not installed (pip install 'kvtier[triton]')"
        )
    devices = {t.device for t in (src, dst) if t.device.type == "cuda"}
    if len(devices) > 1:
        raise TransferError(f"src and dst are on different GPUs: {src.device} and {dst.device}")
    if devices:
        return devices.pop()
    if not interpreting():
        raise BackendUnavailableError(
            f"{call} needs src or dst on a CUDA device (the other pinned on the host), "
            "or TRITON_INTERPRET=1 to run the kernel on CPU tensors"
        )
    return torch.device("cpu")


def to_kernel_device(offsets: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`offsets` on the kernel's device: CPU offsets go up through pinned memory, without blocking."""
    if offsets.device == device:
        return offsets
    if device.type == "cuda" and offsets.device.type == "cpu":
        staged = offsets if offsets.is_pinned() else offsets.pin_memory()
        return staged.to(device, non_blocking=True)
    raise TransferError(f"offsets on {offsets.device} cannot be used by a kernel on {device}")


def launch_on(device: torch.device, kernel: Any, programs: int, args: tuple, kwargs: dict[str, Any]) -> None:
    """Launch `kernel` over a grid of `programs` on the current stream of `device` (or the interpreter)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(programs,)](*args, **kwargs)
