"""A third-party storage backend as `open_backend` loads one by module path: a dict in memory.

Used by tests to prove `MODULE:CLASS?key=value` loading; `options` records what it was built with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.storage.backend import Chunks, StorageBackend


def read_into(value: bytes | None, views) -> int:
    """`value` spread over `views` in order, as `get_into` answers for one key: its length, or -1
    where it is absent or longer than the views (nothing written then)."""
    flat = [memoryview(v).cast("B") for v in views]
    if value is None or len(value) > sum(len(v) for v in flat):
        return -1
    at = 0
    for v in flat:
        n = min(len(v), len(value) - at)
        v[:n] = value[at : at + n]
        at += n
    return len(value)


class MemoryBackend(StorageBackend):
    name = "memory"

    def __init__(self, **options: str) -> None:
        self.options = options
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[str]) -> int:
        with self._lock:
            return next((n for n, k in enumerate(keys) if k not in self._values), len(keys))

    def get_into(self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]) -> list[int]:
        out = []
        for key, views in zip(keys, buffers, strict=True):
            with self._lock:
                value = self._values.get(key)
            out.append(read_into(value, views))
        return out

    def put(self, keys: Sequence[str], values: Sequence[Chunks]) -> list[bool]:
        with self._lock:
            for key, chunks in zip(keys, values, strict=True):
                self._values[key] = b"".join(memoryview(c).cast("B") for c in chunks)
        return [True] * len(keys)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._values), sum(map(len, self._values.values()))
