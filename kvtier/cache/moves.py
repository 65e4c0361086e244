"""The moves of nodes between tiers: back up, load, evict, drop, and their completion.

`NodeMoves` changes nodes' states and slots and keeps every tier's accounting exact: after
each move it `place`s the node, so each tier's queue holds exactly what that tier may
evict. Bytes move only through the device <-> host `Mover` and the storage tier's; the only
waits are on a transfer's own signal.

    (insert) -> device --back_up--> backing_up --backed_up (its signal)--> both
    both --evict_device--> host --load--> loading --loaded (its signal)--> both
    host --drop (evict host)--> dropped
    device --drop (evict device, no host copy)--> dropped (with its host-only subtree)

(each with its storage variants: `kvtier.cache.states` has the table.)

Storage (where the cache has a `StorageTier`): a backup's completion starts its write under
write-through; a host eviction under write-back writes first and drops once written;
host slots a store reads are freed only once it ends.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvtier.cache.agreement import RankAgreement
from kvtier.cache.handles import CacheConfig, LoadHandle, WritePolicy
from kvtier.cache.inflight import InFlight
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.movers import Mover, Transfer
from kvtier.cache.radix import Node, RadixTree
from kvtier.cache.states import Event, transition
from kvtier.cache.storage_tier import StorageTier
from kvtier.cache.tiers import DeviceTier, HostTier, Owner
from kvtier.errors import CacheStateError, InvariantError, SlotError
from kvtier.pool.device import Direction
from kvtier.slots import as_slots
from kvtier.transfer import runs
from kvtier.transfer.submit import Operation

log = logging.getLogger(__name__)


class NodeMoves:
    """Moves nodes of `tree` between `device` and `host` through `mover` (see the module docstring).

    `storage`: the tier below the host, or None; `agreement`: how device allocations are
    agreed over the ranks; `bytes_per_token`: for the byte counters of `metrics`.
    """

    def __init__(
        self,
        tree: RadixTree,
        device: DeviceTier,
        host: HostTier,
        mover: Mover,
        agreement: RankAgreement,
        config: CacheConfig,
        metrics: CacheMetrics,
        bytes_per_token: int,
    ) -> None:
        self.tree, self.device, self.host, self.mover = tree, device, host, mover
        self.agreement, self.config, self.metrics = agreement, config, metrics
        self.bytes_per_token = bytes_per_token
        self.inflight = InFlight()
        self.storage: StorageTier | None = None

    # -- bookkeeping -------------------------------------------------------------------

    def place(self, n: Node) -> None:
        """Put `n` in the queues of the tiers it is in now, and only those."""
        self.device.place(n)
        self.host.place(n)

    def touch(self, nodes: list[Node], hit: bool = False) -> None:
        """Mark a path's nodes used now (and hit, for a match); re-rank them in their queues."""
        now = self.tree.tick()
        for n in nodes:
            n.last_access = now
            n.hits += hit
            self.device.queue.touch(n)
            self.host.queue.touch(n)

    def split(self, node: Node, at: int) -> Node:
        """Split `node` after `at` tokens; the head joins its transfers and queues (and the tail is
        placed again: its slots moved)."""
        head = self.tree.split(node, at)
        if head.transfer in self.inflight:
            self.inflight.add_node(head.transfer, head)
        if self.storage is not None:
            self.storage.split(node, head)
        self.place(head)
        self.place(node)
        return head

    # -- device ------------------------------------------------------------------------

    def alloc_device(self, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """`n` device slots and their runs, evicting from the device when short; on every rank or none."""
        got = self.device.alloc(n)
        if got is None:
            self.evict_device(n - self.device.available())
            got = self.device.alloc(n)
        return self.agreement.device_alloc(got, n, self.device.free, self.device.available())

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots from evictable nodes in policy order; returns freed."""
        return _evict(tokens, self.device.candidates(), self.evict_from_device)

    def evict_host(self, tokens: int) -> int:
        """Free at least `tokens` host slots from evictable host-only leaves in policy order."""
        return _evict(tokens, self.host.candidates(), self.drop_from_host)

    def device_freed(self, slots: np.ndarray) -> int:
        """The pages on `slots` (`[k]` int64), every page after them in their nodes, and those nodes'
        device descendants leave the device, deepest first (device residency stays closed under
        prefixes); `CacheStateError` before anything changes where one is locked. The nodes hit
        come from the tier's index (`ExternalDeviceTier.nodes_on`): no pass over the others."""
        ps = self.tree.page_size
        hit = self.device.nodes_on(slots)  # (node, its first freed page)
        locked = [n for n in _device_subtrees([n for n, _ in hit]) if n.lock]
        if locked:
            raise CacheStateError(f"device_freed: {locked[0]} is locked (a lease or a load holds it)")
        for n, first in hit:
            if first:
                self.split(n, first * ps)  # `n` is the tail from its first freed page on
        tokens = 0
        for n in sorted(_device_subtrees([n for n, _ in hit]), key=lambda n: -len(n.path())):
            if n.state.on_device:
                tokens += self.evict_from_device(n)
        return tokens

    def evict_from_device(self, n: Node) -> int:
        """Move `n` off the device (backing it up first where the policy wants it); returns tokens freed."""
        if n.state.device_only and self.config.write_policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
            self.backup(n)
        if n.state.backing_up:
            self.complete(n.transfer, wait=True)  # waits for this node's backup only
        tokens = len(n)
        self.device.free(n.device_slots)
        n.device_slots = None
        self.metrics.device_evictions += 1
        self.metrics.device_evicted_tokens += tokens
        if n.state.both:
            transition(n, Event.EVICT_DEVICE)
            self.place(n)
            log.debug("evicted %s from the device (host copy kept)", n)
        else:  # no host copy: the node and its (host-only) subtree are gone
            log.debug("evicted %s from the device and dropped it (no host copy)", n)
            self._drop_subtree(n)
        return tokens

    # -- host --------------------------------------------------------------------------

    def backup(self, n: Node) -> bool:
        """Start copying `n` to the host; False when the host has no room even after eviction."""
        if not n.state.device_only:
            raise InvariantError(f"backup of {n}: only a device-only node is backed up")
        got = self.host.alloc(len(n))
        if got is None:
            n.lock += 1  # keep `n` (and so its path) out of the host eviction below
            self.evict_host(len(n) - self.host.available())
            n.lock -= 1
            got = self.host.alloc(len(n))
        if got is None:
            self.metrics.backups_skipped += 1
            log.debug("backup of %s skipped: the host is full of locked nodes", n)
            return False
        slots, host_runs = got
        op = Operation(Direction.BACKUP, (slots,), n.device_slots, (host_runs, slot_runs(n.device_slots)))
        try:
            transfer = self.mover.submit(op)
        except BaseException:
            self.metrics.failed_submissions += 1
            log.info("backup of %s failed to submit; its host slots are given back", n, exc_info=True)
            self.host.free(slots)
            raise
        transition(n, Event.BACK_UP)
        n.host_slots, n.host_runs, n.transfer = slots, host_runs, transfer
        self.place(n)
        self.inflight.track(transfer, [n], None, Direction.BACKUP)
        self.metrics.backups += 1
        self.metrics.bytes_d2h += len(n) * self.bytes_per_token
        return True

    def host_slots_for(self, want: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        """Host slots (and runs) for the first whole pages of `want` tokens, evicting; None: not a page."""
        got = self.host.alloc(want)
        if got is None:
            self.evict_host(want - self.host.available())
            ps = self.tree.page_size
            pages = min(want, self.host.available()) // ps
            got = self.host.alloc(pages * ps) if pages else None
        return got

    def drop_from_host(self, n: Node) -> int:
        """Evict host-only leaf `n` (under write-back, once written); returns the tokens freed now."""
        if self.storage is not None and self.storage.write_back(n):
            return 0  # freed once storage holds it
        return self._drop_host_leaf(n)

    def _drop_host_leaf(self, n: Node) -> int:
        tokens = len(n)
        self.metrics.host_evictions += 1
        self.metrics.host_evicted_tokens += tokens
        self.free_host(n)
        self.tree.remove(n)
        self.place(n)
        log.debug("evicted %s from the host", n)
        return tokens

    def _drop_subtree(self, n: Node) -> None:
        for c in list(n.children.values()):
            self._drop_subtree(c)
        self.metrics.dropped_tokens += len(n)
        self.free_host(n)
        if n.device_slots is not None:
            self.device.free(n.device_slots)
            n.device_slots = None
        self.tree.remove(n)
        self.place(n)

    def free_host(self, n: Node) -> None:
        """Give `n`'s host slots back (after the transfers and storage I/O over them end)."""
        if n.host_slots is not None:
            if n.state.backing_up:
                self.complete(n.transfer, wait=True)
            if self.storage is not None:
                self.storage.await_io(n)
            self.host.free(n.host_slots)
            n.host_slots = n.host_runs = None

    # -- load --------------------------------------------------------------------------

    def check_load(self, nodes: list[Node]) -> None:
        """`CacheStateError` unless `nodes` are host-only, one path, under a node on the device."""
        for n in nodes:
            if not n.state.host_only:
                raise CacheStateError(f"load_back: {n} is not host-only (evicted, loading or resident)")
        for a, b in itertools.pairwise(nodes):
            if b.parent is not a:
                raise CacheStateError("load_back: the nodes are not one path")
        if nodes and nodes[0].parent is not self.tree.root and not nodes[0].parent.state.on_device:
            raise CacheStateError(f"load_back: the parent of {nodes[0]} is not on the device")

    def load_target(self, into: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """`into` checked (`CacheStateError`, `SlotError`): given exactly where the engine owns the
        device, then `[>= tokens]` distinct int64 slots."""
        external = self.device.owner is Owner.ENGINE
        if (into is not None) != external:
            raise CacheStateError(f"load_back: into= is given where the engine owns the device ({external})")
        if into is None:
            return None
        s = torch.from_numpy(as_slots("into", into, self.device.num_slots, distinct=True))
        if len(s) < tokens:
            raise SlotError(f"load_back: {len(s)} slots for {tokens} tokens")
        return s

    def load(self, nodes: list[Node], total: int, into: torch.Tensor | None = None) -> LoadHandle:
        """Submit the load of host-only `nodes` (`total` tokens, one path) into new device slots, or
        into `into` (`[total]` int64: slots an engine that owns the device allocated)."""
        t0 = time.perf_counter()
        self.tree.lock_path(nodes[-1], +1)  # nothing on the path is evicted while it loads
        try:
            dev, dev_runs = self.alloc_device(total) if into is None else (into, slot_runs(into))
        except BaseException:
            self.tree.lock_path(nodes[-1], -1)
            raise
        host_runs = (
            None if any(n.host_runs is None for n in nodes) else [r for n in nodes for r in n.host_runs]
        )
        op = Operation(
            Direction.LOAD,
            tuple(n.host_slots for n in nodes),
            dev,
            None if host_runs is None else (host_runs, dev_runs),
            whole_pages=True,
        )
        try:
            transfer = self.mover.submit(op)
        except BaseException:
            self.metrics.failed_submissions += 1
            log.info(
                "load back of %d tokens failed to submit; its slots are given back", total, exc_info=True
            )
            self.device.free(dev)
            self.tree.lock_path(nodes[-1], -1)
            raise
        at = 0
        for n in nodes:
            transition(n, Event.LOAD)
            n.device_slots = dev if len(nodes) == 1 else dev[at : at + len(n)]
            n.transfer = transfer
            self.place(n)
            at += len(n)
        handle = LoadHandle(nodes, total, dev, transfer, submitted_at=t0)
        handle.submit_s = time.perf_counter() - t0
        self.inflight.track(transfer, list(nodes), handle, Direction.LOAD)
        return handle

    # -- completion --------------------------------------------------------------------

    def complete(self, transfer: Transfer | None, wait: bool) -> None:
        """Finish `transfer` (waiting for it with `wait`): its nodes' states, the load's lock."""
        if transfer not in self.inflight:
            return
        if wait:
            transfer.wait()
        _, nodes, handle = self.inflight.pop(transfer)
        for n in nodes:
            backed_up = n.state.backing_up
            transition(n, Event.BACKED_UP if backed_up else Event.LOADED)
            n.transfer = None
            if backed_up and self.storage is not None and self.storage.write_through:
                self.storage.store(n)
        if handle is not None:
            handle.done = True
            self.metrics.load_seconds.observe(time.perf_counter() - handle.submitted_at)
            self.tree.lock_path(handle.nodes[-1], -1)

    def poll(self) -> None:
        """Complete every transfer whose signal has fired and every storage write that ended."""
        for transfer in self.inflight.done():
            self.complete(transfer, wait=False)
        if self.storage is not None:
            self._drop_stored(self.storage.poll())

    def settle(self) -> None:
        """Wait for every transfer in flight and complete it (storage writes it starts not waited for)."""
        self.mover.drain()
        for transfer, _, _ in self.inflight.records():
            self.complete(transfer, wait=True)
        if self.storage is not None:
            self._drop_stored(self.storage.poll())

    def finish_stores(self) -> None:
        if self.storage is not None:
            self._drop_stored(self.storage.finish())

    def _drop_stored(self, nodes: list[Node]) -> None:
        """Drop the host-only leaves a write-back write has made droppable."""
        for n in nodes:
            if self.host.evictable(n):
                self._drop_host_leaf(n)


def _device_subtrees(nodes: list[Node]) -> list[Node]:
    """`nodes` and every descendant of theirs on the device, each once."""
    out: dict[int, Node] = {}
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.id not in out:
            out[n.id] = n
            stack.extend(c for c in n.children.values() if c.state.on_device)
    return list(out.values())


def _evict(tokens: int, candidates: Iterator[Node], evict: Callable[[Node], int]) -> int:
    """Evict `candidates` in order until `tokens` are freed; returns the tokens freed."""
    freed = 0
    if tokens <= 0:
        return 0
    for n in candidates:
        freed += evict(n)
        if freed >= tokens:
            break
    return freed


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """`(first slot, length)` runs of consecutive ids in `slots` (`[n]` int64 CPU), in order."""
    s = slots.numpy()
    first, lens = runs.starts(runs.breaks(s, 1))
    return list(zip(s[first].tolist(), lens.tolist(), strict=True))
