"""The manager's decisions about the storage tier: what to look up, prefetch, write and when.

`StorageTransitions` is the part of `TierState` that drives a `HostStorageMover`; it never
reads or writes a byte itself. Storage holds pages the tree may no longer know: a `match`
walks the tree, then asks storage (one `lookup`) how many of the following pages it holds.

    acquire: leading storage pages -> a FETCHING leaf (fresh host slots, locked by the lease)
    load_back: wait as the prefetch policy says, stop the fetch, keep what arrived:
               FETCHING --arrived--> HOST (the rest of its slots freed, the leaf cut)
    write_through: BACKING_UP --signal--> BOTH --store--> stored
    write_back: HOST leaf chosen for eviction, not stored --store--> stored --> dropped

Rules: a FETCHING node is a locked leaf that no other call splits, loads or inserts into;
its slots are freed only once its fetch is idle. A node whose host slots a store reads
(`io`) is not evicted from the host, and freeing those slots first waits for the store.
Writes beyond `max_pending_write_tokens` are dropped (counted), so a slow store never
blocks a request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from kvtier.cache.handles import Lease, Match
from kvtier.cache.radix import Node, NodeState
from kvtier.cache.storage_mover import Fetch, HostStorageMover, Store
from kvtier.errors import InvariantError
from kvtier.storage.config import PrefetchPolicy, StorageWrite

if TYPE_CHECKING:
    from kvtier.cache.tiers import TierState

log = logging.getLogger(__name__)


class StorageTransitions:
    """Storage's half of `TierState`'s transitions (see the module docstring)."""

    storage: HostStorageMover | None

    def _init_storage(self: TierState, storage: HostStorageMover | None) -> None:
        self.storage = storage
        self._fetching: dict[int, tuple[Fetch, Node, Lease]] = {}
        self._storing: dict[int, tuple[Store, list[Node]]] = {}
        self._pending_write_tokens = 0

    # -- keys --------------------------------------------------------------------------

    def _hashes(self: TierState, n: Node) -> list[bytes]:
        """`n`'s page hashes, computing (and keeping) those of its path where missing."""
        path = []
        node = n
        while not node.is_root and node.page_hashes is None:
            path.append(node)
            node = node.parent
        for m in reversed(path):
            parent = self.storage.keys.root if m.parent.is_root else m.parent.page_hashes[-1]
            m.page_hashes = self.storage.keys.chain(parent, m.key)
        return n.page_hashes if not n.is_root else []

    # -- lookup and prefetch -----------------------------------------------------------

    def _lookup(self: TierState, key: np.ndarray, matched: int, last: Node) -> tuple[list[bytes], np.ndarray]:
        """The hashes and tokens of the leading pages of `key[matched:]` that storage holds."""
        rest = key[matched:]
        if self.storage is None or not len(rest) or last.state is NodeState.FETCHING:
            return [], rest[:0]
        if any(c.state is NodeState.FETCHING for c in last.children.values()):
            return [], rest[:0]  # a fetch of (part of) these pages is already in flight
        if len(rest) >= self.spec.page_size and self.tree.page_key(rest) in last.children:
            return [], rest[:0]  # the tree holds the next page: a match cut to agree with other ranks
        parent = self._hashes(last)[-1] if not last.is_root else self.storage.keys.root
        hashes = self.storage.keys.chain(parent, rest)
        m = self.storage.metrics
        m.add("lookups")
        k = self.storage.lookup(hashes)
        tokens = k * self.spec.page_size
        if 0 < tokens < self.storage.config.min_tokens:
            m.add("skipped_short_tokens", tokens)
            return [], rest[:0]
        found = rest[:tokens].copy()
        found.flags.writeable = False  # it becomes a node's key
        return hashes[:k], found

    def _start_fetch(self: TierState, match: Match, lease: Lease) -> None:
        """Give the match's storage pages host slots and start reading them (see the module docstring).

        The pages fetched are those every rank has host slots for (`_agree_pages`).
        """
        ps = self.spec.page_size
        want = len(match.storage_hashes) * ps
        inserted = self.tree.page_key(match.storage_key) in match.last_node.children
        got = None if inserted else self._host_slots_for_fetch(want)
        pages = self._agree_pages(len(got[0]) // ps if got is not None else 0)
        if got is not None and pages * ps < len(got[0]):
            self.host_alloc.free(got[0])
            got = self.host_alloc.alloc_runs(pages * ps) if pages else None
        if inserted:
            return  # these pages were inserted since the match: nothing to fetch
        if got is None:
            self.storage.metrics.add("prefetch_abandoned_tokens", want)
            return
        slots, host_runs = got
        node = self.tree.add_child(
            match.last_node,
            match.storage_key[: pages * ps],
            None,
            state=NodeState.FETCHING,
            host_slots=slots,
            host_runs=host_runs,
            page_hashes=list(match.storage_hashes[:pages]),
            stored=True,
        )
        self._touch(node.path(), hit=False)  # one tick for the path: no node ranks above its parent
        self.tree.lock_path(node, +1)  # the lease now holds the path down to the fetch
        self.tree.lock_path(lease.node, -1)
        lease.node = node
        fetch = self.storage.fetch(list(zip(node.page_hashes, slots[::ps].tolist(), strict=True)))
        node.io = fetch
        self._fetching[id(fetch)] = (fetch, node, lease)
        match.prefetch = fetch
        self.storage.metrics.add("prefetches")

    def _host_slots_for_fetch(self: TierState, want: int):
        """Host slots (and runs) for the first whole pages of `want` tokens, evicting; None: not a page."""
        got = self.host_alloc.alloc_runs(want)
        if got is None:
            self._evict_host(want - self.host_alloc.available())
            ps = self.spec.page_size
            pages = min(want, self.host_alloc.available()) // ps
            got = self.host_alloc.alloc_runs(pages * ps) if pages else None
        return got

    def _take_prefetch(self: TierState, match: Match) -> Node | None:
        """`load_back`'s end of the match's prefetch: the HOST node of what arrived on every rank."""
        fetch, match.prefetch = match.prefetch, None
        return self._settle_fetch(fetch, wait=True, agree=True)

    def _settle_fetch(self: TierState, fetch: Fetch | None, wait: bool, agree: bool = False) -> Node | None:
        """End `fetch` (after waiting as the policy says, with `wait`): returns its HOST node, if any.

        With `agree` (a collective: `load_back` on every rank) it keeps the pages that arrived
        on every rank; otherwise those that arrived here.
        """
        rec = self._fetching.pop(id(fetch), None) if fetch is not None else None
        if rec is None:
            if agree:
                self._agree_pages(0)
            return None
        _, node, lease = rec
        cfg = self.storage.config
        if wait and cfg.prefetch is PrefetchPolicy.WAIT_COMPLETE:
            fetch.wait()
        elif wait and cfg.prefetch is PrefetchPolicy.TIMEOUT:
            fetch.wait(cfg.prefetch_timeout_s(len(node)))
        fetch.stop()
        fetch.wait()  # no worker writes these slots after this
        node.io = None
        arrived = fetch.arrived()
        arrived = (self._agree_pages(arrived) if agree else arrived) * self.spec.page_size
        m = self.storage.metrics
        m.observe("prefetch_seconds", time.perf_counter() - fetch.started)
        m.add("prefetched_tokens", arrived)
        m.add("prefetch_abandoned_tokens", len(node) - arrived)  # before the cut below
        self.metrics.storage_hit_tokens += arrived
        self.metrics.miss_tokens -= arrived  # counted a miss by `match` until it came
        total = len(node)
        head = self.tree.split(node, arrived) if 0 < arrived < total else node
        if arrived < total:  # the tail that did not arrive: its slots back, the leaf cut
            tail = node
            keep = head if arrived else tail.parent
            self.tree.lock_path(keep, +1)
            self.tree.lock_path(tail, -1)
            lease.node = keep
            self.host_alloc.free(tail.host_slots)
            self.tree.remove(tail)
        if not arrived:
            return None
        head.state = NodeState.HOST
        head.io = None
        self._place(head)
        return head

    def _settle_fetches_of(self: TierState, lease: Lease) -> None:
        for fetch, _, held in list(self._fetching.values()):
            if held is lease:
                self._settle_fetch(fetch, wait=False)

    # -- writes ------------------------------------------------------------------------

    def _store(self: TierState, n: Node, *, force: bool = False) -> bool:
        """Start writing `n`'s host pages to storage; False where it is not (stored, busy, or dropped)."""
        if (
            not self.writes_storage  # no storage, or another rank writes these bytes
            or n.stored
            or n.io is not None
            or n.state
            not in (
                NodeState.BOTH,
                NodeState.HOST,
            )
        ):
            return False
        if not force and self._pending_write_tokens + len(n) > self.storage.config.max_pending_write_tokens:
            self.storage.metrics.add("writes_dropped")
            return False
        ps = self.spec.page_size
        store = self.storage.store(list(zip(self._hashes(n), n.host_slots[::ps].tolist(), strict=True)))
        n.io = store
        self._storing[id(store)] = (store, [n])
        self._pending_write_tokens += len(n)
        return True

    def _store_done(self: TierState, store: Store, drop: bool = True) -> None:
        """Mark `store`'s nodes stored (or not); with `drop`, free those write-back evicts."""
        rec = self._storing.pop(id(store), None)
        if rec is None:
            return
        nodes = rec[1]
        for n in nodes:
            self._pending_write_tokens -= len(n)
            n.io = None
            n.stored = store.ok
            if drop and n.evict_when_stored and n.state is NodeState.HOST and self._host_leaf(n):
                self._drop_from_host(n)

    def _await_io(self: TierState, n: Node) -> None:
        """Wait for the storage I/O over `n`'s host slots to end (before they are freed)."""
        if isinstance(n.io, Store):
            n.io.wait()
            self._store_done(n.io, drop=False)  # the caller frees the slots itself
        elif n.io is not None:
            raise InvariantError(f"{n}: its host slots are freed while a fetch writes them")

    def _write_back(self, n: Node) -> bool:
        """Under `write_back`, start storing `n` instead of dropping it now; True when it waits."""
        if self.storage is None or self.storage.config.write is not StorageWrite.WRITE_BACK or n.stored:
            return False
        if n.evict_when_stored and n.io is None:
            return False  # its write was tried and failed: drop it now
        if n.io is None and not self._store(n):
            return False
        n.evict_when_stored = True
        return True

    # -- completion --------------------------------------------------------------------

    def _poll_storage(self: TierState) -> None:
        for store, _ in [r for r in self._storing.values() if r[0].done]:
            self._store_done(store)

    def _finish_stores(self: TierState) -> None:
        """Wait for every storage write in flight and complete it."""
        for store, _ in list(self._storing.values()):
            store.wait()
            self._store_done(store)

    def _close_storage(self: TierState) -> None:
        """Stop every fetch (keeping what arrived), write what write-back holds, finish every write."""
        if self.storage is None:
            return
        for fetch, _, _ in list(self._fetching.values()):
            self._settle_fetch(fetch, wait=False)
        if self.storage.config.write is StorageWrite.WRITE_BACK:
            for n in self.tree.nodes():
                self._store(n, force=True)
        self._finish_stores()
        self.storage.close()
