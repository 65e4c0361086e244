"""Memory pools: `DevicePool` (one tensor per buffer per layer) and `HostPool` (pinned, chunked)."""

from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostLayout, HostPool
from kvtier.pool.rows import as_words

__all__ = ["DevicePool", "HostLayout", "HostPool", "as_words"]
