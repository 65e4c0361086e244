"""The storage tier's bookkeeping: what to look up, prefetch and write, and the I/O in flight.

`StorageTier` drives a `HostStorageMover` through its operations (`LookupPages`,
`ReadPages`, `WritePages`) and never reads or writes a byte itself. Storage holds pages the
tree may no longer know: a `match` walks the tree, then asks storage (one `LookupPages`) how
many of the following pages it holds.

    acquire: leading storage pages -> a `fetching` leaf (fresh host slots, locked by the lease)
    load_back: wait as the prefetch policy says, stop the fetch, keep what arrived:
               fetching --arrived--> host_stored (the rest dropped: its slots freed, the leaf cut)
    write_through: backing_up --backed_up--> both --store--> both_storing --stored--> both_stored
    write_back: a `host` leaf chosen for eviction --write_back--> host_writing_back
               --stored (or store_failed)--> host_stored (or host) --> dropped

(`kvtier.cache.states` has every transition.) Rules: a `fetching` node is a locked leaf
that no other call splits, loads or inserts into; its slots are freed only once its fetch
is idle. A `*_storing` node is not evicted from the host, and freeing its host slots first
waits for the write. Writes beyond `max_pending_write_tokens` are dropped (counted), so a
slow store never blocks a request. The nodes whose write-back write ended are handed back
to the caller (`poll`, `finish`), which drops them; a failed write-back is dropped too, and
tried again only if the node is evicted again later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvtier.cache.handles import Lease, Match
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.radix import Node, RadixTree
from kvtier.cache.states import Event, NodeState, transition
from kvtier.cache.storage_mover import Fetch, HostStorageMover, LookupPages, ReadPages, Store, WritePages
from kvtier.cache.tiers import HostTier, Tier
from kvtier.errors import InvariantError
from kvtier.spec import KVSpec
from kvtier.storage.config import PrefetchPolicy, StorageWrite

log = logging.getLogger(__name__)


class StorageTier(Tier):
    """The tier below the host, over `mover` (see the module docstring).

    As a `Tier`: it holds the nodes whose pages it stores; its room is the write budget
    (`max_pending_write_tokens`: `alloc` / `free` of tokens being written); it evicts
    nothing (a backend ages its pages out itself). `bind` gives it the cache's tree and
    host tier before any call: `writes`, whether this rank writes pages
    (`RankAgreement.writes_storage`); `agree_pages`, the least of every rank's page count;
    `place`, re-queue a node whose state changed; `touch`, mark a path used now.
    """

    name = "storage"

    def __init__(self, mover: HostStorageMover) -> None:
        self.mover, self.config, self.metrics = mover, mover.config, mover.metrics
        self._fetching: dict[int, tuple[Fetch, Node, Lease]] = {}  # by id(fetch)
        self._storing: dict[int, tuple[Store, list[Node]]] = {}  # by id(store)
        self._store_of: dict[int, Store] = {}  # by node id: the write reading its host slots
        self.pending_write_tokens = 0

    def bind(
        self,
        spec: KVSpec,
        tree: RadixTree,
        host: HostTier,
        metrics: CacheMetrics,
        *,
        writes: bool,
        agree_pages: Callable[[int], int],
        place: Callable[[Node], None],
        touch: Callable[[list[Node]], None],
    ) -> None:
        self.spec, self.tree, self.host, self.cache_metrics = spec, tree, host, metrics
        self.writes = writes
        self._agree_pages, self._place, self._touch = agree_pages, place, touch

    # -- the tier's interface -------------------------------------------------------------

    def holds(self, n: Node) -> bool:
        return n.state.stored

    def alloc(self, n: int) -> int | None:
        """`n` tokens of the write budget, or None (counted as a dropped write) where they would pass it."""
        if self.pending_write_tokens + n > self.config.max_pending_write_tokens:
            self.metrics.add("writes_dropped")
            return None
        self.pending_write_tokens += n
        return n

    def free(self, n: int) -> None:
        self.pending_write_tokens -= n

    def candidates(self) -> Iterator[Node]:
        return iter(())

    @property
    def write_through(self) -> bool:
        return self.config.write is StorageWrite.WRITE_THROUGH

    def fetching(self) -> list[tuple[Fetch, Node, Lease]]:
        return list(self._fetching.values())

    def storing(self) -> list[tuple[Store, list[Node]]]:
        return list(self._storing.values())

    def split(self, tail: Node, head: Node) -> None:
        """`head`, split off `tail` which a store reads, is stored by that store too."""
        store = self._store_of.get(tail.id)
        if store is not None:
            self._store_of[head.id] = store
            self._storing[id(store)][1].append(head)

    def store_of(self, n: Node) -> Store | None:
        return self._store_of.get(n.id)

    def _fetch_of(self, n: Node) -> Fetch | None:
        return next((f for f, node, _ in self._fetching.values() if node is n), None)

    # -- keys --------------------------------------------------------------------------

    def hashes(self, n: Node) -> list[bytes]:
        """`n`'s page hashes, computing (and keeping) those of its path where missing."""
        path = []
        node = n
        while not node.is_root and node.page_hashes is None:
            path.append(node)
            node = node.parent
        keys = self.mover.keys
        for m in reversed(path):
            parent = keys.root if m.parent.is_root else m.parent.page_hashes[-1]
            m.page_hashes = keys.chain(parent, m.key)
        return n.page_hashes if not n.is_root else []

    # -- lookup and prefetch -----------------------------------------------------------

    def lookup(self, key: np.ndarray, matched: int, last: Node) -> tuple[list[bytes], np.ndarray]:
        """The hashes and tokens of the leading pages of `key[matched:]` that storage holds."""
        rest = key[matched:]
        if not len(rest) or last.state is NodeState.FETCHING:
            return [], rest[:0]
        if any(c.state is NodeState.FETCHING for c in last.children.values()):
            return [], rest[:0]  # a fetch of (part of) these pages is already in flight
        if len(rest) >= self.spec.page_size and self.tree.page_key(rest) in last.children:
            return [], rest[:0]  # the tree holds the next page: a match cut to agree with other ranks
        parent = self.hashes(last)[-1] if not last.is_root else self.mover.keys.root
        hashes = self.mover.keys.chain(parent, rest)
        m = self.metrics
        m.add("lookups")
        k = self.mover.submit(LookupPages(hashes)).pages
        tokens = k * self.spec.page_size
        if 0 < tokens < self.config.min_tokens:
            m.add("skipped_short_tokens", tokens)
            return [], rest[:0]
        found = rest[:tokens].copy()
        found.flags.writeable = False  # it becomes a node's key
        return hashes[:k], found

    def start_fetch(
        self, match: Match, lease: Lease, got: tuple[torch.Tensor, list[tuple[int, int]]] | None
    ) -> None:
        """Start reading the match's storage pages into host slots `got` (see the module docstring).

        The pages fetched are those every rank has host slots for (`agree_pages`); `got` is
        None where the pages were inserted since the match (nothing to fetch, but the ranks
        still agree) or the host has no room for a page.
        """
        ps = self.spec.page_size
        want = len(match.storage_hashes) * ps
        inserted = self.tree.page_key(match.storage_key) in match.last_node.children
        pages = self._agree_pages(len(got[0]) // ps if got is not None else 0)
        if got is not None and pages * ps < len(got[0]):
            self.host.free(got[0])
            got = self.host.alloc(pages * ps) if pages else None
        if inserted:
            return  # these pages were inserted since the match: nothing to fetch
        if got is None:
            self.metrics.add("prefetch_abandoned_tokens", want)
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
        )
        self._touch(node.path())  # one tick for the path: no node ranks above its parent
        self.tree.lock_path(node, +1)  # the lease now holds the path down to the fetch
        self.tree.lock_path(lease.node, -1)
        lease.node = node
        fetch = self.mover.submit(ReadPages(list(zip(node.page_hashes, slots[::ps].tolist(), strict=True))))
        self._fetching[id(fetch)] = (fetch, node, lease)
        match.prefetch = fetch
        self.metrics.add("prefetches")

    def settle_fetch(self, fetch: Fetch | None, wait: bool, agree: bool = False) -> Node | None:
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
        cfg = self.config
        if wait and cfg.prefetch is PrefetchPolicy.WAIT_COMPLETE:
            fetch.wait()
        elif wait and cfg.prefetch is PrefetchPolicy.TIMEOUT:
            fetch.wait(cfg.prefetch_timeout_s(len(node)))
        fetch.stop()
        fetch.wait()  # no worker writes these slots after this
        arrived = fetch.arrived()
        arrived = (self._agree_pages(arrived) if agree else arrived) * self.spec.page_size
        m = self.metrics
        m.observe("prefetch_seconds", time.perf_counter() - fetch.started)
        m.add("prefetched_tokens", arrived)
        m.add("prefetch_abandoned_tokens", len(node) - arrived)  # before the cut below
        self.cache_metrics.storage_hit_tokens += arrived
        self.cache_metrics.miss_tokens -= arrived  # counted a miss by `match` until it came
        total = len(node)
        head = self.tree.split(node, arrived) if 0 < arrived < total else node
        if arrived < total:  # the tail that did not arrive: its slots back, the leaf cut
            tail = node
            keep = head if arrived else tail.parent
            self.tree.lock_path(keep, +1)
            self.tree.lock_path(tail, -1)
            lease.node = keep
            self.host.free(tail.host_slots)
            self.tree.remove(tail)
        if not arrived:
            return None
        transition(head, Event.ARRIVED)
        self._place(head)
        return head

    def settle_fetches_on(self, key: np.ndarray) -> None:
        """End the fetches whose nodes lie on `key`'s path, so an insert never meets one."""
        if not self._fetching:
            return  # (no second walk of the tree when nothing is being fetched)
        nodes, _, partial, _ = self.tree.walk(key)
        for n in [*nodes, *([partial] if partial is not None else [])]:
            if n.state is NodeState.FETCHING:
                self.settle_fetch(self._fetch_of(n), wait=False)

    def settle_fetches_of(self, lease: Lease) -> None:
        for fetch, _, held in list(self._fetching.values()):
            if held is lease:
                self.settle_fetch(fetch, wait=False)

    # -- writes ------------------------------------------------------------------------

    def store(self, n: Node, *, force: bool = False, evict: bool = False) -> bool:
        """Start writing `n`'s host pages to storage (with `evict`, a write-back eviction's); False
        where it is not (another rank writes them, not a readable unstored host copy, over the cap)."""
        readable = (NodeState.HOST,) if evict else (NodeState.BOTH, NodeState.HOST)
        if not self.writes or n.state not in readable:
            return False
        if force:
            self.pending_write_tokens += len(n)
        elif self.alloc(len(n)) is None:
            return False
        ps = self.spec.page_size
        pages = list(zip(self.hashes(n), n.host_slots[::ps].tolist(), strict=True))
        store = self.mover.submit(WritePages(pages))
        transition(n, Event.WRITE_BACK if evict else Event.STORE)
        self._store_of[n.id] = store
        self._storing[id(store)] = (store, [n])
        return True

    def _store_done(self, store: Store) -> list[Node]:
        """Mark `store`'s nodes stored (or not); returns those a write-back eviction waits for."""
        rec = self._storing.pop(id(store), None)
        if rec is None:
            return []
        evicted = []
        for n in rec[1]:
            self.free(len(n))
            del self._store_of[n.id]
            if n.state is NodeState.HOST_WRITING_BACK:
                evicted.append(n)
            transition(n, Event.STORED if store.ok else Event.STORE_FAILED)
        return evicted

    def await_io(self, n: Node) -> None:
        """Wait for the storage I/O over `n`'s host slots to end (before they are freed)."""
        store = self._store_of.get(n.id)
        if store is not None:
            store.wait()
            self._store_done(store)  # the caller frees the slots itself
        elif n.state is NodeState.FETCHING:
            raise InvariantError(f"{n}: its host slots are freed while a fetch writes them")

    def write_back(self, n: Node) -> bool:
        """Under `write_back`, start storing `n` instead of dropping it now; True when it waits."""
        return self.config.write is StorageWrite.WRITE_BACK and self.store(n, evict=True)

    # -- completion --------------------------------------------------------------------

    def poll(self) -> list[Node]:
        """Complete the writes that ended; returns the nodes write-back may drop now."""
        out: list[Node] = []
        for store, _ in [r for r in self._storing.values() if r[0].done()]:
            out += self._store_done(store)
        return out

    def finish(self) -> list[Node]:
        """Wait for every write in flight and complete it; returns the nodes write-back may drop now."""
        out: list[Node] = []
        for store, _ in list(self._storing.values()):
            store.wait()
            out += self._store_done(store)
        return out

    def close(self) -> None:
        """Stop every fetch (keeping what arrived), write what write-back holds, finish every write,
        close the mover."""
        for fetch, _, _ in list(self._fetching.values()):
            self.settle_fetch(fetch, wait=False)
        if self.config.write is StorageWrite.WRITE_BACK:
            for n in self.tree.nodes():
                self.store(n, force=True)
        self.finish()
        self.mover.close()
