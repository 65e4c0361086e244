"""The tiered radix prefix cache: tree (`radix`), lanes (`streams`), and the `CacheController`."""

from kvtier.cache.controller import (
    CacheConfig,
    CacheController,
    CacheMetrics,
    Lease,
    LoadHandle,
    Match,
    WritePolicy,
    token_ids,
)
from kvtier.cache.radix import Node, NodeState, RadixTree

__all__ = [
    "CacheConfig",
    "CacheController",
    "CacheMetrics",
    "Lease",
    "LoadHandle",
    "Match",
    "Node",
    "NodeState",
    "RadixTree",
    "WritePolicy",
    "token_ids",
]
