"""Byte-exact views of KV rows.

Transfers move rows as raw words, whatever the buffer's dtype: fp8 and bf16 bit
patterns (NaN payloads included) survive unchanged, and on a GPU a row moves in
8-byte words instead of single bytes.
"""

from __future__ import annotations

import math

import torch

WORD_DTYPES: dict[int, torch.dtype] = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides `row_bytes`."""
    for size, dtype in WORD_DTYPES.items():
        if row_bytes % size == 0:
            return dtype
    raise AssertionError("unreachable: 1 divides every row size")


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row of `t` (`[n, *row]`) is contiguous and rows are packed back to back."""
    if t.dim() < 1:
        return False
    return t[0].is_contiguous() and (t.shape[0] <= 1 or t.stride(0) == t[0].numel())


def as_words(t: torch.Tensor) -> torch.Tensor:
    """View `t` (`[n, *row]`, rows packed) as `[n, row_bytes // w]` words of the widest width w."""
    flat = t.view(t.shape[0], math.prod(t.shape[1:]))
    raw = flat.view(torch.uint8)
    return raw.view(word_dtype(raw.shape[1]))


def flat_words(t: torch.Tensor, size: int) -> torch.Tensor:
    """A 1-D contiguous words tensor `t` re-viewed as words of `size` bytes (a trailing part dropped)."""
    dtype = WORD_DTYPES[size]
    if t.dtype == dtype:
        return t
    raw = t.view(torch.uint8)
    return raw[: raw.numel() // size * size].view(dtype)
