"""How a cache is put together from its tiers: the collaborators, built once and wired.

`compose_tiers(tiers, config, ranks)` takes the tiers top first and checks they make a
cache: a device tier (kvtier's `DeviceTier` or an engine's `ExternalDeviceTier`), a
`HostTier` (every move passes through the host), and optionally a `StorageTier`; all of
one spec. It builds the parts a `CacheController` is made of (`CacheParts`): the radix
tree, the rank agreement, the node moves, and wires the storage tier to them.
`compose(device_pool, host_pool, ...)` is the classic configuration as a list. Nothing here
runs after construction; `kvtier.cache.invariants` reads the same parts.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from kvtier.cache.tiers import DeviceTier, HostTier, Tier
from kvtier.errors import CacheStateError, ConfigError
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


def compose_tiers(
    tiers: Sequence[Tier], config: CacheConfig | None = None, ranks: RankGroup | None = None
) -> CacheParts:
    """The parts of a cache over `tiers` (top first); `ConfigError` for a list that is not a cache,
    `CacheStateError` for tiers of different specs. With several `ranks`, a collective."""
    kinds = [type(t).__name__ for t in tiers]
    ok = (
        len(tiers) in (2, 3)
        and isinstance(tiers[0], DeviceTier)
        and isinstance(tiers[1], HostTier)
        and (len(tiers) == 2 or isinstance(tiers[2], StorageTier))
    )
    if not ok:
        raise ConfigError(f"cache tiers {kinds}: a device tier, a host tier, then optionally a storage tier")
    device, host = tiers[0], tiers[1]
    storage = tiers[2] if len(tiers) == 3 else None
    dspec, hspec = device.pool.spec, host.pool.spec
    if dspec.buffers != hspec.buffers or dspec.page_size != hspec.page_size:
        raise CacheStateError("device and host pools must be built from the same spec")
    cfg = config or CacheConfig()
    mover = host.mover or DeviceHostMover(
        device.pool, host.pool, costs=cfg.costs, kernel=cfg.kernel, force=cfg.force_path
    )
    host.mover = mover
    tree = RadixTree(dspec.page_size)
    metrics = CacheMetrics()
    agreement = RankAgreement(ranks, dspec, storage.mover if storage is not None else None)
    moves = NodeMoves(tree, device, host, mover, agreement, cfg, metrics, dspec.bytes_per_token())
    if storage is not None:
        moves.storage = storage
        storage.bind(
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
        dspec, cfg, device.pool, host.pool, mover, tree, device, host, metrics, agreement, moves, storage
    )


def classic_tiers(
    device_pool: DevicePool,
    host_pool: HostPool,
    config: CacheConfig | None = None,
    *,
    mover: Mover | None = None,
    storage: HostStorageMover | None = None,
) -> list[Tier]:
    """kvtier's own device tier over `device_pool`, the host tier, storage where given."""
    cfg = config or CacheConfig()
    policy = cfg.eviction.make()
    tiers: list[Tier] = [
        DeviceTier(device_pool, policy),
        HostTier(host_pool, policy, cfg.host_alloc_policy, mover),
    ]
    if storage is not None:
        tiers.append(StorageTier(storage))
    return tiers
