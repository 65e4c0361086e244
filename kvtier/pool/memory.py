"""Memory ownership: what holds memory until `close()`, how much host RAM a pool may take,
and giving freed memory back to the OS.

A host pool asks `host_memory_bytes()` before it allocates anything and keeps
`default_reserve_bytes` free for everything else. When it closes,
`return_freed_memory` makes the release visible to the OS at once instead of
leaving the freed blocks cached inside this process.
"""

from __future__ import annotations

import ctypes
import os
from typing import TypeVar

import torch

GiB = 1 << 30

_O = TypeVar("_O", bound="Owner")


class Owner:
    """Holds memory until `close()` (idempotent); a context manager that closes on leaving."""

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether `close()` has run: the memory is released and the object takes no more work."""
        return self._closed

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _O) -> _O:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_memory_bytes() -> tuple[int, int]:
    """`(available, total)` bytes of host RAM, from /proc/meminfo where it exists."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


def default_reserve_bytes(total: int) -> int:
    """Host memory kept free for everything else: 10% of RAM, at least 2 GiB."""
    return max(2 * GiB, total // 10)


def return_freed_memory(pinned: bool) -> None:
    """Hand memory this process just freed back to the OS instead of keeping it for reuse.

    Empties torch's caching host allocator (pinned blocks) and trims glibc's heap (pageable
    blocks below its mmap threshold); each is skipped where this torch or C library lacks it.
    """
    if pinned:
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def fmt_bytes(nbytes: int) -> str:
    """`nbytes` in GiB or MiB, for messages."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"
