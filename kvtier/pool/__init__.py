"""Memory pools: `DevicePool` (one tensor per buffer per layer) and `HostPool` (pinned, chunked)."""

from kvtier.pool.device import DevicePool
from kvtier.pool.host import HostLayout, HostPool

__all__ = ["DevicePool", "HostLayout", "HostPool"]
