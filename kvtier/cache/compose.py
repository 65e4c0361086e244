"""How a cache is put together: its collaborators, built once and wired to each other.

`compose` builds, from the pools, movers and config a `CacheController` is given, the parts
it is made of (`CacheParts`): the radix tree, the device and host tiers, the rank
agreement, the node moves and (with a storage mover) the storage tier. Nothing here runs
after construction; `kvtier.cache.invariants` reads the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.cache.agreement import RankAgreement
from kvtier.cache.handles import CacheConfig
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.movers import DeviceHostMover, Mover
from kvtier.cache.moves import NodeMoves
from kvtier.cache.radix import RadixTree
from kvtier.cache.ranks import RankGroup
from kvtier.cache.storage_mover import HostStorageMover
from kvtier.cache.storage_tier import StorageTier
from kvtier.cache.tiers import DeviceTier, HostTier
from kvtier.errors import CacheStateError
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import KVSpec


@dataclass(frozen=True)
class CacheParts:
    """A cache's collaborators (see the module docstring)."""

    spec: KVSpec
    config: CacheConfig
    device_pool: DevicePool
    host_pool: HostPool
    mover: Mover
    tree: RadixTree
    device: DeviceTier
    host: HostTier
    metrics: CacheMetrics
    agreement: RankAgreement
    moves: NodeMoves
    storage: StorageTier | None


def compose(
    device_pool: DevicePool,
    host_pool: HostPool,
    config: CacheConfig | None = None,
    *,
    mover: Mover | None = None,
    storage: HostStorageMover | None = None,
    ranks: RankGroup | None = None,
) -> CacheParts:
    """The parts of a cache over `device_pool` and `host_pool` (see `CacheController`).

    `CacheStateError` where the pools are of different specs; with several `ranks`, a
    collective (`RankAgreement`'s checks).
    """
    dspec, hspec = device_pool.spec, host_pool.spec
    if dspec.buffers != hspec.buffers or dspec.page_size != hspec.page_size:
        raise CacheStateError("device and host pools must be built from the same spec")
    cfg = config or CacheConfig()
    ps = dspec.page_size
    mover = mover or DeviceHostMover(
        device_pool, host_pool, costs=cfg.costs, kernel=cfg.kernel, force=cfg.force_path
    )
    tree = RadixTree(ps)
    policy = cfg.eviction.make()
    device = DeviceTier(device_pool.num_slots, ps, policy)
    host = HostTier(host_pool.num_slots, ps, cfg.host_alloc_policy, policy)
    metrics = CacheMetrics()
    agreement = RankAgreement(ranks, dspec, storage)
    moves = NodeMoves(tree, device, host, mover, agreement, cfg, metrics, dspec.bytes_per_token())
    tier = None
    if storage is not None:
        tier = moves.storage = StorageTier(
            storage,
            dspec,
            tree,
            host,
            metrics,
            writes=agreement.writes_storage,
            agree_pages=agreement.pages,
            place=moves.place,
            touch=moves.touch,
        )
    return CacheParts(
        dspec, cfg, device_pool, host_pool, mover, tree, device, host, metrics, agreement, moves, tier
    )
