"""The tiered prefix cache a serving engine drives: the manager that holds the metadata and decides.

`CacheController` owns the radix tree, both tiers' allocators, the leases, the write
policies and an eviction queue per tier (through `TierState`); every byte moves through
its `Mover`, so it never touches a stream, a runtime call or an address. Its contract:

- `match(tokens)`: the longest cached prefix, its device part (slots, ready) and its
  host-only nodes (to `load_back`); `acquire(match)` locks the path, `release(lease)`
  unlocks it once; locked nodes are never evicted.
- `load_back(match)`: device slots (contiguous where possible), one operation for every
  buffer, a `LoadHandle` whose `wait_layer(i)` makes the current stream wait for layer i.
- `alloc_device(n)` / `insert(tokens, slots)` / `free_device(slots)`: a request's slots.
- Write policies: back up at insert (`write_through`), after `selective_hits` hits
  (`write_through_selective`) or at eviction (`write_back`); a node counts as backed up
  once its backup's signal has fired.
- Storage (with a `HostStorageMover`, `kvtier.cache.storage_tier`): `match` also asks the
  store how many following pages it holds (`Match.storage_tokens`), `acquire` starts
  fetching them into host slots, `load_back` waits as the prefetch policy says and loads
  what arrived; host pages are written to the store in the background; a store fault is a
  miss, counted in `storage.metrics`.
- `settle()` completes every transfer in flight (starting the storage writes they
  release); `flush()` also waits for those writes.
- `evict_device(k)` / `evict_host(k)`: unlocked leaves in `EvictionPolicy` order,
  O(evicted x log nodes).
- Ranks (`ranks`, a `RankGroup`): `match`, device allocations and prefetches are agreed
  over the ranks, so every rank answers each call alike (`kvtier.cache.agreement`).
- `check_invariants()` raises `InvariantError` (`kvtier.cache.invariants` lists them).
- `close()` completes every transfer, stops the mover and closes both pools; later calls
  raise `ClosedError`.

Errors (`SlotError`, `LeaseError`, `CacheStateError`, `CacheFullError`) are raised before
anything changes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.cache.handles import Lease, LoadHandle, Match, WritePolicy
from kvtier.cache.movers import Transfer
from kvtier.cache.radix import Node, NodeState, token_ids
from kvtier.cache.tiers import TierState
from kvtier.errors import CacheFullError, CacheStateError, ClosedError, LeaseError, SlotError
from kvtier.pool.device import Direction
from kvtier.slots import NO_SLOTS, as_slots, concat_slots, fmt_ids
from kvtier.transfer.submit import Operation

log = logging.getLogger(__name__)


class CacheController(TierState):
    """The tiered radix cache over `device_pool` and `host_pool` (same spec); see the module docstring.

    `mover`: what moves bytes between the two pools (default: a `DeviceHostMover` with the
    config's transfer options). The controller owns both pools from here on and closes them.
    `ranks`: the tensor-parallel ranks whose caches answer every call alike
    (`kvtier.cache.agreement`); every rank then makes the same calls in the same order.
    """

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Complete every transfer in flight, stop the mover, close both pools (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
            self._close_storage()
            self.mover.close()
        finally:
            self._closed = True
            self.device_pool.close()
            self.host_pool.close()
            log.info(
                "cache closed (%d nodes, %d leases outstanding)", len(self.tree.nodes()), len(self._leases)
            )

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        if self._closed:
            raise ClosedError("the cache is closed")

    # -- queries -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | torch.Tensor | np.ndarray) -> Match:
        """The longest cached prefix of `tokens` (whole pages); counts hits, refreshes the policy's order.

        `tokens`: `[n]` integer ids; an int32 or int64 array or CPU tensor is matched without
        a copy. Keys keep the dtype they were inserted with: keep one dtype for `insert` and
        `match` (ids of another dtype compare correctly but cast as they go, slower). With
        several ranks, a collective: the counts are agreed (`kvtier.cache.agreement`).
        """
        self._open()
        self.poll()
        key = self.tree.whole_pages(token_ids(tokens))
        nodes, _, partial, shared = self.tree.walk(key)
        if partial is not None and partial.state is not NodeState.FETCHING:
            nodes.append(self._split(partial, shared))
        for n in nodes:
            if n.state is NodeState.LOADING:
                self._complete(n.transfer, wait=True)
        device_nodes = list(itertools.takewhile(lambda n: n.state.on_device, nodes))
        host_nodes = list(  # (a FETCHING node ends the match: its bytes are not here yet)
            itertools.takewhile(lambda n: n.state is NodeState.HOST, nodes[len(device_nodes) :])
        )
        device_nodes, host_nodes, storage_hashes, storage_key = self._agree_match(
            key, device_nodes, host_nodes
        )
        nodes = device_nodes + host_nodes
        self._touch(nodes, hit=True)
        device_tokens = sum(len(n) for n in device_nodes)
        matched = device_tokens + sum(len(n) for n in host_nodes)
        last = nodes[-1] if nodes else self.tree.root
        if self.storage is not None:
            self.storage.metrics.add("hit_tokens", len(storage_key))
        m = self.metrics
        m.matches += 1
        m.device_hit_tokens += device_tokens
        m.host_hit_tokens += matched - device_tokens
        m.miss_tokens += len(tokens) - matched  # storage tokens move from here once they arrive
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for n in device_nodes:
                if n.state is NodeState.DEVICE and n.hits >= self.config.selective_hits:
                    self._backup(n)
        return Match(
            tokens=matched,
            device_tokens=device_tokens,
            device_slots=concat_slots([n.device_slots for n in device_nodes]),
            device_nodes=device_nodes,
            host_nodes=host_nodes,
            last_node=last,
            storage_hashes=storage_hashes,
            storage_key=storage_key if len(storage_key) else None,
        )

    def active_leases(self) -> list[Lease]:
        """The leases held now (acquired and not released)."""
        return list(self._leases.values())

    def held_slots(self) -> np.ndarray:
        """`[k]` int64: device slots requests hold (from `alloc_device`, not inserted or freed), ascending."""
        return np.flatnonzero(self._held)

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
            self._start_fetch(match, lease)
        return lease

    def release(self, lease: Lease) -> None:
        """Unlock a lease's path (ending its prefetch, if one runs); a lease is released once."""
        if lease.released or self._leases.get(lease.id) is not lease:
            raise LeaseError(f"lease {lease.id} is not held (released twice, or not from this cache)")
        self._settle_fetches_of(lease)
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
        slots, _ = self._alloc_device(int(n))
        self._held[slots.numpy()] = True
        return slots

    def free_device(self, slots: torch.Tensor) -> None:
        """Return device slots a request holds and did not insert."""
        self._open()
        s = as_slots("slots", slots, self.device_pool.num_slots)
        not_held = s[~self._held[s]]
        if len(not_held):
            raise SlotError(f"free_device: slots {fmt_ids(not_held)} are not held by a request")
        self.device_alloc.free(s)
        self._held[s] = False

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
        s = self._check_insert(key, device_slots)
        self._settle_fetches_on(key)  # (after the checks: a refused insert changes nothing)
        nodes, pos, partial, shared = self.tree.walk(key)
        if partial is not None:
            nodes.append(self._split(partial, shared))
        adopted = self._take_slots(nodes, s)
        last = nodes[-1] if nodes else self.tree.root
        covered = pos + shared
        if covered < len(key):
            new = s[covered:]
            last = self.tree.add_child(last, key[covered:], torch.from_numpy(new.copy()))
            self._held[new] = False
            self._place(last)
            adopted.append(last)
        self._touch([*nodes, *([last] if covered < len(key) else [])], hit=False)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            for n in adopted:
                self._backup(n)
        return last

    def _settle_fetches_on(self, key: np.ndarray) -> None:
        """End the fetches whose nodes lie on `key`'s path, so an insert never meets one."""
        if not self._fetching:
            return  # (no second walk of the tree when nothing is being fetched)
        nodes, _, partial, _ = self.tree.walk(key)
        for n in [*nodes, *([partial] if partial is not None else [])]:
            if n.state is NodeState.FETCHING:
                self._settle_fetch(n.io, wait=False)

    def _check_insert(self, key: np.ndarray, device_slots: torch.Tensor) -> np.ndarray:
        """`insert`'s checks, before anything changes: the slots as `[n]` int64."""
        ps = self.spec.page_size
        if len(key) % ps:
            raise SlotError(f"insert: {len(key)} tokens is not a whole number of pages of {ps}")
        s = as_slots("device_slots", device_slots, self.device_pool.num_slots, distinct=True)
        if len(s) != len(key):
            raise SlotError(f"insert: {len(key)} tokens but {len(s)} device slots")
        nodes, pos, partial, shared = self.tree.walk(key)
        tree_slots = np.full(len(key), -1, dtype=np.int64)
        at = 0
        for n in [*nodes, *([partial] if partial is not None else [])]:
            length = len(n) if n is not partial else shared
            if n.state.on_device:
                tree_slots[at : at + length] = n.device_slots[:length].numpy()
            at += length
        covered = pos + shared
        own = tree_slots[:covered] == s[:covered]
        must_hold = np.concatenate([s[:covered][~own], s[covered:]])
        if len(must_hold) and not self._held[must_hold].all():
            bad = must_hold[~self._held[must_hold]]
            raise SlotError(f"insert: device slots {fmt_ids(bad)} are not held by the caller")
        return s

    def _take_slots(self, nodes: list[Node], s: np.ndarray) -> list[Node]:
        """Along `nodes`: free the caller's duplicates of device slots, adopt them for host-only
        nodes; returns the adopted nodes."""
        adopted: list[Node] = []
        at = 0
        for n in nodes:
            mine = s[at : at + len(n)]
            at += len(n)
            if n.state.on_device:
                if not (n.device_slots.numpy() == mine).all():
                    self.device_alloc.free(mine)
                    self._held[mine] = False
                continue
            self._free_host(n)  # host only: take the caller's fresh KV, drop the host copy
            n.device_slots = torch.from_numpy(mine.copy())
            n.state = NodeState.DEVICE
            self._place(n)
            self._held[mine] = False
            adopted.append(n)
        return adopted

    # -- load back ---------------------------------------------------------------------

    def load_back(self, match: Match) -> LoadHandle:
        """Bring the match's host-only nodes to the device; returns a handle with per-layer readiness.

        A prefetch from storage (started by `acquire`) is first waited for as the storage
        config's policy says; what arrived joins the match's host nodes.
        """
        self._open()
        self.poll()
        if match.storage_hashes:
            got = self._take_prefetch(match)
            if got is not None:
                match.host_nodes.append(got)
                match.last_node = got
                match.tokens += len(got)
                match.storage_tokens_used = len(got)
        nodes = list(match.host_nodes)
        self._check_load(nodes)
        total = sum(len(n) for n in nodes)
        if total == 0:
            return LoadHandle([], 0, NO_SLOTS, done=True)
        if total < self.config.recompute_below:
            self.metrics.recomputed_tokens += total
            return LoadHandle(nodes, total, NO_SLOTS, recompute=True, done=True)
        t0 = time.perf_counter()
        self.tree.lock_path(nodes[-1], +1)  # nothing on the path is evicted while it loads
        try:
            dev, dev_runs = self._alloc_device(total)
        except CacheFullError:
            self.tree.lock_path(nodes[-1], -1)
            raise
        runs = (
            None
            if any(n.host_runs is None for n in nodes)
            else ([r for n in nodes for r in n.host_runs], dev_runs)
        )
        op = Operation(Direction.LOAD, tuple(n.host_slots for n in nodes), dev, runs, whole_pages=True)
        try:
            transfer = self.mover.submit(op)
        except BaseException:
            self.metrics.failed_submissions += 1
            log.info(
                "load back of %d tokens failed to submit; its slots are given back", total, exc_info=True
            )
            self.device_alloc.free(dev)
            self.tree.lock_path(nodes[-1], -1)
            raise
        at = 0
        for n in nodes:
            n.device_slots = dev if len(nodes) == 1 else dev[at : at + len(n)]
            n.state, n.transfer = NodeState.LOADING, transfer
            self._place(n)
            at += len(n)
        handle = LoadHandle(nodes, total, dev, transfer, submitted_at=t0)
        handle.submit_s = time.perf_counter() - t0
        self._track(transfer, list(nodes), handle, Direction.LOAD)
        m = self.metrics
        m.loads += 1
        m.loaded_tokens += total
        m.bytes_h2d += total * self.bytes_per_token
        m.load_submit_s += handle.submit_s
        return handle

    def _check_load(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.state is not NodeState.HOST:
                raise CacheStateError(f"load_back: {n} is not host-only (evicted, loading or resident)")
        for a, b in itertools.pairwise(nodes):
            if b.parent is not a:
                raise CacheStateError("load_back: the nodes are not one path")
        if nodes and nodes[0].parent is not self.tree.root and not nodes[0].parent.state.on_device:
            raise CacheStateError(f"load_back: the parent of {nodes[0]} is not on the device")

    # -- eviction ----------------------------------------------------------------------

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots from unlocked leaves in policy order; returns freed."""
        self._open()
        return self._evict_device(tokens)

    def evict_host(self, tokens: int) -> int:
        """Free at least `tokens` host slots from unlocked host-only leaves in policy order."""
        self._open()
        return self._evict_host(tokens)

    # -- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Complete every transfer whose signal has fired (no waiting).

        A mover completes loads in order and backups in order, so each scan stops at the
        first unfinished one: O(completed), however many are in flight.
        """
        for queue in self._submitted.values():
            while queue:
                transfer = queue[0]
                if id(transfer) in self._inflight:
                    if not transfer.done():
                        break
                    self._complete(transfer, wait=False)
                queue.popleft()
        self._poll_storage()

    def settle(self) -> None:
        """Wait for every transfer in flight and complete it, starting the storage writes it releases.

        Those writes are not waited for (`flush` does): what a server does while it idles, so
        write-through pages reach storage without waiting for the next request's `poll`.
        """
        self.mover.drain()
        for transfer, _, _ in list(self._inflight.values()):
            self._complete(transfer, wait=True)
        self._poll_storage()

    def flush(self) -> None:
        """Wait for every transfer in flight and every storage write, and complete them (tests, shutdown)."""
        self.settle()
        self._finish_stores()

    # -- reporting ---------------------------------------------------------------------

    def fragmentation(self) -> dict[str, int]:
        return {
            "host_free_slots": self.host_alloc.available(),
            "host_free_runs": self.host_alloc.free_runs(),
            "host_largest_free_run": self.host_alloc.largest_free_run(),
            "device_free_slots": self.device_alloc.available(),
            "device_free_runs": self.device_alloc.free_runs(),
            "device_largest_free_run": self.device_alloc.largest_free_run(),
        }

    def check_invariants(self, compare_bytes: bool = True) -> None:
        """Raise `InvariantError` naming the first broken invariant (O(cache); tests and debugging)."""
        from kvtier.cache.invariants import check

        check(self, compare_bytes)

    def in_flight(self) -> list[tuple[Transfer, list[Node], LoadHandle | None]]:
        """Transfers submitted and not yet completed: `(transfer, nodes, load handle or None)`."""
        return list(self._inflight.values())
