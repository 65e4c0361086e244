"""How the storage tier behaves: `StorageConfig` (validated when built) and its enums.

`url` names the backend (`kvtier.storage.backend.open_backend`); the rest are policies:

- `write`: `write_through` stores each page once its host copy is complete (the default);
  `write_back` stores a host page when it is evicted from the host (and frees its slots
  once stored).
- `prefetch`: how long `load_back` waits for pages coming from storage: `best_effort`
  (use what has arrived), `wait_complete`, or `timeout` (`timeout_base_s` plus
  `timeout_per_1k_s` per 1000 tokens, at most `timeout_max_s`).
- `min_tokens`: storage hits shorter than this are not prefetched (recomputed instead).
- `compression`: `none`, `lz4` or `zstd` (lossless, byte planes split first).
- `size_bytes`: the file backend's cap (LRU beyond it; 0 = no cap); `pool_size`, `ttl_s`,
  `timeout_s`: the Redis backends' connection pool, key TTL (0 = none) and socket timeout.
- `workers`: threads reading from storage; `writers`: threads writing; `batch_pages`:
  pages per backend call; `max_pending_write_tokens`: tokens waiting to be written
  beyond which new writes are dropped (counted), so a slow store never blocks a request.
- `model`: the model identity the page keys are namespaced by (`kvtier.storage.keys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtier.errors import ConfigError


class StorageWrite(str, Enum):
    """When host pages are written to storage."""

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


class PrefetchPolicy(str, Enum):
    """How long a load waits for pages still coming from storage."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class Compression(str, Enum):
    """Lossless compression of a page's payload (byte planes split first)."""

    NONE = "none"
    LZ4 = "lz4"
    ZSTD = "zstd"


@dataclass(frozen=True)
class StorageConfig:
    """The storage tier's backend and policies; see the module docstring."""

    url: str
    write: StorageWrite = StorageWrite.WRITE_THROUGH
    prefetch: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    timeout_base_s: float = 2.0
    timeout_per_1k_s: float = 0.1
    timeout_max_s: float = 30.0
    min_tokens: int = 0
    compression: Compression = Compression.NONE
    size_bytes: int = 0
    pool_size: int = 16
    ttl_s: int = 0
    timeout_s: float = 5.0
    workers: int = 4
    writers: int = 2
    batch_pages: int = 16
    max_pending_write_tokens: int = 1 << 20
    model: str = ""
    backend_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "write", StorageWrite(self.write))
            object.__setattr__(self, "prefetch", PrefetchPolicy(self.prefetch))
            object.__setattr__(self, "compression", Compression(self.compression))
        except ValueError as e:
            raise ConfigError(f"storage config: {e}") from None
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"storage config: url must be a non-empty string, got {self.url!r}")
        counts = {"workers": self.workers, "writers": self.writers, "batch_pages": self.batch_pages}
        if any(v < 1 for v in counts.values()):
            raise ConfigError(f"storage config: {counts} must all be at least 1")
        nonneg = {
            "min_tokens": self.min_tokens,
            "size_bytes": self.size_bytes,
            "ttl_s": self.ttl_s,
            "max_pending_write_tokens": self.max_pending_write_tokens,
            "timeout_base_s": self.timeout_base_s,
            "timeout_per_1k_s": self.timeout_per_1k_s,
            "timeout_max_s": self.timeout_max_s,
        }
        if any(v < 0 for v in nonneg.values()) or self.pool_size < 1 or self.timeout_s <= 0:
            raise ConfigError(
                f"storage config: {nonneg} must be at least 0, pool_size ({self.pool_size}) at least 1 "
                f"and timeout_s ({self.timeout_s}) positive"
            )

    def prefetch_timeout_s(self, tokens: int) -> float:
        """How long a load waits for a prefetch of `tokens` under the `timeout` policy."""
        return min(self.timeout_max_s, self.timeout_base_s + self.timeout_per_1k_s * tokens / 1000)

    def open_options(self, scheme: str) -> dict[str, Any]:
        """The keyword options `open_backend` passes to the backend of `scheme`."""
        if scheme == "file":
            base = {"size_bytes": self.size_bytes}
        elif scheme in ("redis", "redis+cluster"):
            base = {"pool_size": self.pool_size, "ttl_s": self.ttl_s, "timeout_s": self.timeout_s}
        else:
            base = {}
        return {**base, **self.backend_options}
