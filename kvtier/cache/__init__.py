"""The tiered prefix cache: the manager (`CacheController`), eviction policies and movers.

`CacheController` decides (tree, leases, write policies, evictions); an `EvictionPolicy`
ranks each tier's leaves; a `Mover` per pair of tiers moves the bytes.
"""

from kvtier.cache.handles import CacheConfig, Lease, LoadHandle, Match, WritePolicy
from kvtier.cache.manager import CacheController
from kvtier.cache.metrics import CacheMetrics, Histogram
from kvtier.cache.movers import DeviceHostMover, Mover, Transfer
from kvtier.cache.policy import LFU, LRU, EvictionPolicy, PolicyName
from kvtier.cache.radix import Node, token_ids
from kvtier.cache.states import NodeState

__all__ = [
    "LFU",
    "LRU",
    "CacheConfig",
    "CacheController",
    "CacheMetrics",
    "DeviceHostMover",
    "EvictionPolicy",
    "Histogram",
    "Lease",
    "LoadHandle",
    "Match",
    "Mover",
    "Node",
    "NodeState",
    "PolicyName",
    "Transfer",
    "WritePolicy",
    "token_ids",
]
