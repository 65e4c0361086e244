"""The tiered prefix cache: a manager (`CacheController`) built from a list of tiers.

Layout, one module a line; each imports only modules above it (`tests/test_cache_imports.py`
holds this order and fails on any cycle, type-only imports included):

- `states.py`: a node's lifecycle, one state machine (`NodeState`, `Event`, `TABLE`,
  `transition`); its transition table is in its docstring.
- `metrics.py`: the counters (`CacheMetrics`, `StorageMetrics`, `Histogram`).
- `movers.py`: the `Mover` interface (`submit(op) -> handle`, `drain`, `close`) and
  `DeviceHostMover` (device <-> host bytes).
- `storage_io.py`: the storage mover's operations (`LookupPages`, `ReadPages`, `WritePages`)
  and their handles (`Found`, `Fetch`, `Store`).
- `storage_mover.py`: `HostStorageMover`, the `Mover` of host <-> storage bytes (worker
  threads, faults as misses, refused values deleted or written over).
- `radix.py`: the radix tree over token ids at page granularity (`RadixTree`, `Node`).
- `policy.py`: eviction policies (`LRU`, `LFU`) and the per-tier `EvictionQueue`.
- `tiers.py`: the `Tier` interface and the slot tiers (`DeviceTier`, `ExternalDeviceTier`
  for an engine's own blocks, `HostTier`).
- `handles.py`: what callers get (`Match`, `Lease`, `LoadHandle`) and `CacheConfig`.
- `ranks.py`: the tensor-parallel ranks (`RankGroup`) and their collectives.
- `agreement.py`: how the ranks' caches agree on every answer (`RankAgreement`).
- `storage_tier.py`: the storage tier's bookkeeping (`StorageTier`: lookups, prefetches,
  writes in flight).
- `inflight.py`: the device <-> host transfers in flight, in submission order (`InFlight`).
- `moves.py`: the moves of nodes between tiers and their completion (`NodeMoves`).
- `insert.py`: `insert`'s checks before anything changes and the slots it adopts.
- `compose.py`: the tiers checked and the collaborators built and wired (`compose_tiers`).
- `invariants.py`: `check_invariants`, every node's state against its slots and I/O.
- `manager.py`: `CacheController`, the calls an engine makes.

A node's states and the transitions between them: `kvtier.cache.states` (its docstring's
table is `states.TABLE`, a test holds them equal; `transition` refuses any other move
with `TransitionError`).

A cache is `[device tier, HostTier, optional StorageTier]` (`CacheController.of(tiers)`;
`CacheController(device_pool, host_pool, ...)` builds the classic list). The device tier
is kvtier's (`DeviceTier`) or an engine's (`ExternalDeviceTier`: the engine says which
blocks hold which pages through `insert`, and which it freed through `device_freed`;
kvtier loads into blocks it is given, `load_back(match, into=)`, and never allocates).

What a new tier needs:
- a storage backend (a third tier on another service): only `kvtier/storage/` (a
  `StorageBackend` subclass and its URL scheme); the cache reaches it through
  `HostStorageMover` unchanged.
- a fourth tier (e.g. below storage, or between host and storage): a `Tier` subclass in
  its own module (what it holds, `alloc` / `free`, `candidates`), a `Mover` between it
  and the tier above (its operation and handle types), its states and transitions in
  `states.py` (rows in both tables), the moves that use them in `moves.py` (or a
  collaborator of its own, as `storage_tier.py`), its place in `compose.py`'s list check,
  and its checks in `invariants.py`.
"""

from kvtier.cache.handles import CacheConfig, Lease, LoadHandle, Match, WritePolicy
from kvtier.cache.manager import CacheController
from kvtier.cache.metrics import CacheMetrics, Histogram
from kvtier.cache.movers import DeviceHostMover, Mover, Transfer
from kvtier.cache.policy import LFU, LRU, EvictionPolicy, PolicyName
from kvtier.cache.radix import Node, token_ids
from kvtier.cache.states import Event, NodeState, TransitionError
from kvtier.cache.storage_tier import StorageTier
from kvtier.cache.tiers import DeviceTier, ExternalDeviceTier, HostTier, Owner, Tier

__all__ = [
    "LFU",
    "LRU",
    "CacheConfig",
    "CacheController",
    "CacheMetrics",
    "DeviceHostMover",
    "DeviceTier",
    "Event",
    "EvictionPolicy",
    "ExternalDeviceTier",
    "Histogram",
    "HostTier",
    "Lease",
    "LoadHandle",
    "Match",
    "Mover",
    "Node",
    "NodeState",
    "Owner",
    "PolicyName",
    "StorageTier",
    "Tier",
    "Transfer",
    "TransitionError",
    "WritePolicy",
    "token_ids",
]
