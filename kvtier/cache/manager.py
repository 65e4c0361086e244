"""The tiered prefix cache a serving engine drives: the manager that holds the metadata and decides.

`CacheController` holds the leases and answers the calls below; it is built from a list
of tiers (`CacheController.of`, `kvtier.cache.compose`) and composed of collaborators with
one job each: the radix tree, each tier's slots and eviction queue (`DeviceTier` or an
engine's `ExternalDeviceTier`, `HostTier`), the moves of nodes between tiers (`NodeMoves`),
the storage tier's bookkeeping (`StorageTier`) and the ranks' agreement (`RankAgreement`).
Every byte moves through a mover, so it never touches a stream or an address. Contract:

- `match(tokens)`: the longest cached prefix, its device part (slots, ready) and its
  host-only nodes (to `load_back`); `acquire(match)` locks the path, `release(lease)`
  unlocks it once; locked nodes are never evicted.
- `load_back(match)`: device slots (contiguous where possible), one operation for every
  buffer, a `LoadHandle` whose `wait_layer(i)` makes the current stream wait for layer i.
- `alloc_device(n)` / `insert(tokens, slots)` / `free_device(slots)`: a request's slots.
  Where an engine owns the device: `insert` with its blocks' slots, `device_freed(slots)`
  when it frees blocks, `load_back(match, into=slots)`; `alloc_device` is refused.
- Write policies: back up at insert (`write_through`), after `selective_hits` hits
  (`write_through_selective`) or at eviction (`write_back`); a node counts as backed up
  once its backup's signal has fired.
- Storage (with a `HostStorageMover`, through a `StorageTier`): `match` also asks the
  store how many following pages it holds (`Match.storage_tokens`), `acquire` starts
  fetching them into host slots, `load_back` waits as the prefetch policy says and loads
  what arrived; host pages are written to the store in the background; a store fault is a
  miss, counted in `storage.metrics`.
- `settle()` completes every transfer in flight (starting the storage writes they
  release); `flush()` also waits for those writes.
- `evict_device(k)` / `evict_host(k)`: unlocked leaves in `EvictionPolicy` order,
  O(evicted x log nodes).
- Ranks (`ranks`): `match`, device allocations and prefetches are agreed over the ranks.
- `check_invariants()` raises `InvariantError` (`kvtier.cache.invariants` lists them);
  `close()` completes every transfer, stops the movers, closes the pools.

Errors (`SlotError`, `LeaseError`, `CacheStateError`, `CacheFullError`) are raised before
anything changes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.cache.compose import CacheParts, classic_tiers, compose_tiers
from kvtier.cache.handles import CacheConfig, Lease, LoadHandle, Match, WritePolicy
from kvtier.cache.insert import check_insert, take_slots
from kvtier.cache.invariants import check
from kvtier.cache.movers import Mover, Transfer
from kvtier.cache.radix import Node, token_ids
from kvtier.cache.ranks import RankGroup
from kvtier.cache.states import NodeState
from kvtier.cache.storage_mover import HostStorageMover
from kvtier.cache.tiers import Owner, Tier
from kvtier.errors import CacheStateError, ClosedError, LeaseError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.slots import NO_SLOTS, as_slots, concat_slots

log = logging.getLogger(__name__)


class CacheController:
    """The tiered radix cache over `device_pool` and `host_pool` (same spec); see the module docstring.

    `mover`: what moves bytes between the two pools (default: a `DeviceHostMover` with the
    config's transfer options). The controller owns both pools from here on and closes them.
    `storage`: the mover to a third tier below the host, or None. `ranks`: the
    tensor-parallel ranks whose caches answer every call alike (`RankAgreement`; None: one
    process); every rank then makes the same calls in the same order, and the constructor
    is a collective.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        config: CacheConfig | None = None,
        *,
        mover: Mover | None = None,
        storage: HostStorageMover | None = None,
        ranks: RankGroup | None = None,
    ) -> None:
        tiers = classic_tiers(device_pool, host_pool, config, mover=mover, storage=storage)
        self._build(compose_tiers(tiers, config, ranks))

    @classmethod
    def of(
        cls, tiers: Sequence[Tier], config: CacheConfig | None = None, *, ranks: RankGroup | None = None
    ) -> CacheController:
        """A cache built from `tiers`, top first (`kvtier.cache.compose.compose_tiers`): e.g. an
        engine's `ExternalDeviceTier`, a `HostTier` and a `StorageTier`."""
        cache = cls.__new__(cls)
        cache._build(compose_tiers(tiers, config, ranks))
        return cache

    def _build(self, p: CacheParts) -> None:
        self.parts = p
        self.spec, self.config, self.mover = p.spec, p.config, p.mover
        self.device_pool, self.host_pool = p.device_pool, p.host_pool
        self.tree, self.device, self.host, self.metrics = p.tree, p.device, p.host, p.metrics
        self.agreement, self.moves, self.storage_tier = p.agreement, p.moves, p.storage
        self.bytes_per_token = self.spec.bytes_per_token()
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._closed = False

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Complete every transfer in flight, stop the movers, close both pools (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
            if self.storage_tier is not None:
                self.storage_tier.close()
            self.mover.close()
        finally:
            self._closed = True
            self.device_pool.close()
            self.host_pool.close()
            log.info(
                "cache closed (%d nodes, %d leases outstanding)", len(self.tree.nodes()), len(self._leases)
            )

    closed = property(lambda self: self._closed)

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    # -- collaborators' parts, by their former names -------------------------------------

    @property
    def storage(self) -> HostStorageMover | None:
        """The mover to the storage tier (its backend, keys, metrics), or None."""
        return self.storage_tier.mover if self.storage_tier is not None else None

    @property
    def ranks(self) -> RankGroup:
        return self.agreement.ranks

    @property
    def device_alloc(self):
        return self.device.allocator

    @property
    def host_alloc(self):
        return self.host.allocator

    # -- queries -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | torch.Tensor | np.ndarray) -> Match:
        """The longest cached prefix of `tokens` (whole pages); counts hits, refreshes the policy's order.

        `tokens`: `[n]` integer ids; an int32 or int64 array or CPU tensor is matched without
        a copy. Keys keep the dtype they were inserted with: keep one dtype for `insert` and
        `match` (ids of another dtype compare correctly but cast as they go, slower). With
        several ranks, a collective: the counts are agreed (`RankAgreement`).
        """
        self._open()
        self.poll()
        key = self.tree.whole_pages(token_ids(tokens))
        nodes, _, partial, shared = self.tree.walk(key)
        if partial is not None and partial.state is not NodeState.FETCHING:
            nodes.append(self.moves.split(partial, shared))
        for n in nodes:
            if n.state.loading:
                self.moves.complete(n.transfer, wait=True)
        device_nodes = list(itertools.takewhile(lambda n: n.state.on_device, nodes))
        host_nodes = list(  # (a FETCHING node ends the match: its bytes are not here yet)
            itertools.takewhile(lambda n: n.state.host_only, nodes[len(device_nodes) :])
        )
        device_nodes, host_nodes, storage_hashes, storage_key = self.agreement.match(
            key, device_nodes, host_nodes, self.tree.root, self.storage_tier
        )
        nodes = device_nodes + host_nodes
        self.moves.touch(nodes, hit=True)
        device_tokens = sum(len(n) for n in device_nodes)
        matched = device_tokens + sum(len(n) for n in host_nodes)
        if self.storage is not None:
            self.storage.metrics.add("hit_tokens", len(storage_key))
        m = self.metrics
        m.matches += 1
        m.device_hit_tokens += device_tokens
        m.host_hit_tokens += matched - device_tokens
        m.miss_tokens += len(tokens) - matched  # storage tokens move from here once they arrive
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for n in device_nodes:
                if n.state.device_only and n.hits >= self.config.selective_hits:
                    self.moves.backup(n)
        return Match(
            tokens=matched,
            device_tokens=device_tokens,
            device_slots=concat_slots([n.device_slots for n in device_nodes]),
            device_nodes=device_nodes,
            host_nodes=host_nodes,
            last_node=nodes[-1] if nodes else self.tree.root,
            storage_hashes=storage_hashes,
            storage_key=storage_key if len(storage_key) else None,
        )

    def active_leases(self) -> list[Lease]:
        """The leases held now (acquired and not released)."""
        return list(self._leases.values())

    def held_slots(self) -> np.ndarray:
        """`[k]` int64: device slots requests hold (from `alloc_device`, not inserted or freed), ascending."""
        return self.device.held_slots()

    # -- locks -------------------------------------------------------------------------

    def acquire(self, match: Match | Node) -> Lease:
        """Lock the path to the match's last node for a request; start prefetching its storage pages."""
        self._open()
        node = match.last_node if isinstance(match, Match) else match
        if node.state is NodeState.DROPPED:
            raise CacheStateError(f"{node} was evicted; match again")
        lease = Lease(next(self._lease_ids), node)
        self.tree.lock_path(node, +1)
        self._leases[lease.id] = lease
        if isinstance(match, Match) and match.storage_hashes and match.prefetch is None:
            inserted = self.tree.page_key(match.storage_key) in match.last_node.children
            want = len(match.storage_hashes) * self.spec.page_size
            got = None if inserted else self.moves.host_slots_for(want)
            self.storage_tier.start_fetch(match, lease, got)
        return lease

    def release(self, lease: Lease) -> None:
        """Unlock a lease's path (ending its prefetch, if one runs); a lease is released once."""
        if lease.released or self._leases.get(lease.id) is not lease:
            raise LeaseError(f"lease {lease.id} is not held (released twice, or not from this cache)")
        if self.storage_tier is not None:
            self.storage_tier.settle_fetches_of(lease)
        lease.released = True
        del self._leases[lease.id]
        self.tree.lock_path(lease.node, -1)

    # -- device slots for requests -----------------------------------------------------

    def alloc_device(self, n: int) -> torch.Tensor:
        """`[n]` device slots for a request's new tokens, evicting from the device when short."""
        self._open()
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0 or n % self.spec.page_size:
            raise SlotError(f"alloc_device({n!r}): not a whole number of pages of {self.spec.page_size}")
        if n == 0:
            return NO_SLOTS
        slots, _ = self.moves.alloc_device(int(n))
        self.device.hold(slots.numpy())
        return slots

    def free_device(self, slots: torch.Tensor) -> None:
        """Return device slots a request holds and did not insert."""
        self._open()
        self.device.free_held(slots)

    # -- insert ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int] | torch.Tensor | np.ndarray, device_slots: torch.Tensor) -> Node:
        """Give the tree a request's tokens (whole pages) and the device slots their KV is in.

        `device_slots`: `[len(tokens)]` int64 CPU. Positions the tree already holds on the
        device keep the tree's slots; the caller's slots there (if different) are freed.
        Host-only positions take the caller's slots (the host copy is dropped). Every other
        slot must be held by the caller (`alloc_device`). Returns the deepest node of `tokens`.
        """
        self._open()
        self.poll()
        key = token_ids(tokens, copy=True)
        key.flags.writeable = False
        s = check_insert(self.tree, self.device, key, device_slots)
        if self.storage_tier is not None:  # (after the checks: a refused insert changes nothing)
            self.storage_tier.settle_fetches_on(key)
        nodes, pos, partial, shared = self.tree.walk(key)
        if partial is not None:
            nodes.append(self.moves.split(partial, shared))
        adopted = take_slots(self.moves, nodes, s)
        last = nodes[-1] if nodes else self.tree.root
        covered = pos + shared
        if covered < len(key):
            new = s[covered:]
            last = self.tree.add_child(last, key[covered:], torch.from_numpy(new.copy()))
            self.device.unhold(new)
            self.moves.place(last)
            adopted.append(last)
        self.moves.touch([*nodes, *([last] if covered < len(key) else [])])
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            for n in adopted:
                self.moves.backup(n)
        return last

    # -- load back ---------------------------------------------------------------------

    def load_back(self, match: Match, into: torch.Tensor | None = None) -> LoadHandle:
        """Bring the match's host-only nodes to the device; returns a handle with per-layer readiness.

        A prefetch from storage (started by `acquire`) is first waited for as the storage
        config's policy says; what arrived joins the match's host nodes. `into`: with a
        device tier the engine owns (and only then), the `[>= host + storage tokens]` int64
        device slots it allocated for them (`ExternalDeviceTier.slots(block_ids)`); the load
        fills the first `handle.tokens`.
        """
        self._open()
        into = self.moves.load_target(into, match.host_tokens + match.storage_tokens)
        self.poll()
        if match.storage_hashes:
            fetch, match.prefetch = match.prefetch, None
            got = self.storage_tier.settle_fetch(fetch, wait=True, agree=True)
            if got is not None:
                match.host_nodes.append(got)
                match.last_node = got
                match.tokens += len(got)
                match.storage_tokens_used = len(got)
        nodes = list(match.host_nodes)
        self.moves.check_load(nodes)
        total = sum(len(n) for n in nodes)
        if total == 0:
            return LoadHandle([], 0, NO_SLOTS, done=True)
        if total < self.config.recompute_below:
            self.metrics.recomputed_tokens += total
            return LoadHandle(nodes, total, NO_SLOTS, recompute=True, done=True)
        handle = self.moves.load(nodes, total, None if into is None else into[:total])
        m = self.metrics
        m.loads += 1
        m.loaded_tokens += total
        m.bytes_h2d += total * self.bytes_per_token
        m.load_submit_s += handle.submit_s
        return handle

    # -- eviction ----------------------------------------------------------------------

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots from unlocked leaves in policy order; returns freed."""
        self._open()
        return self.moves.evict_device(tokens)

    def evict_host(self, tokens: int) -> int:
        """Free at least `tokens` host slots from unlocked host-only leaves in policy order."""
        self._open()
        return self.moves.evict_host(tokens)

    def device_freed(self, slots: torch.Tensor) -> int:
        """The engine that owns the device freed these slots (`ExternalDeviceTier.slots(block_ids)`):
        their nodes leave the device, backed up first as the write policy says, their device
        descendants with them. `CacheStateError` (nothing changed) where one is locked (a
        lease or a load holds it) or kvtier owns the device. Returns the tokens that left."""
        self._open()
        if self.device.owner is not Owner.ENGINE:
            raise CacheStateError("device_freed: the device tier is kvtier's own (evict_device frees it)")
        return self.moves.device_freed(as_slots("slots", slots, self.device.num_slots))

    # -- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Complete every transfer whose signal has fired (no waiting).

        A mover completes loads in order and backups in order, so each scan stops at the
        first unfinished one: O(completed), however many are in flight.
        """
        self.moves.poll()

    def settle(self) -> None:
        """Wait for every transfer in flight and complete it, starting the storage writes it releases.

        Those writes are not waited for (`flush` does): what a server does while it idles, so
        write-through pages reach storage without waiting for the next request's `poll`.
        """
        self.moves.settle()

    def flush(self) -> None:
        """Wait for every transfer in flight and every storage write, and complete them (tests, shutdown)."""
        self.settle()
        self.moves.finish_stores()

    # -- reporting ---------------------------------------------------------------------

    def fragmentation(self) -> dict[str, int]:
        return {**self.host.fragmentation(), **self.device.fragmentation()}

    def check_invariants(self, compare_bytes: bool = True) -> None:
        """Raise `InvariantError` naming the first broken invariant (O(cache); tests and debugging)."""
        check(self.parts, self.active_leases(), compare_bytes)

    def in_flight(self) -> list[tuple[Transfer, list[Node], LoadHandle | None]]:
        """Transfers submitted and not yet completed: `(transfer, nodes, load handle or None)`."""
        return self.moves.inflight.records()
