"""The cache's state across tiers and the moves of a node between them.

`TierState` holds what the manager decides over: the radix tree, each tier's slot
allocator and eviction queue, the device slots held by requests, the leases and the
transfers in flight. Its methods are the node transitions the manager composes:

    (insert) -> DEVICE --backup--> BACKING_UP --signal--> BOTH --evict device--> HOST
    HOST --load back--> LOADING --signal--> BOTH;  HOST --evict host--> dropped
    DEVICE --evict device, no host copy--> dropped (with its host-only subtree)
    (acquire of storage pages) -> FETCHING --arrived--> HOST   (`kvtier.cache.storage_tier`)

Each transition keeps the tier queues exact (`_place`): the device queue holds every node
with device slots, the host queue every host-only node. Bytes move only through the
mover; the only waits are on a transfer's own signal.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import numpy as np
import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.cache.agreement import RankAgreement
from kvtier.cache.handles import CacheConfig, Lease, LoadHandle, WritePolicy
from kvtier.cache.metrics import CacheMetrics
from kvtier.cache.movers import DeviceHostMover, Mover, Transfer
from kvtier.cache.policy import EvictionQueue
from kvtier.cache.radix import Node, NodeState, RadixTree
from kvtier.cache.ranks import RankGroup
from kvtier.cache.storage_mover import HostStorageMover
from kvtier.cache.storage_tier import StorageTransitions
from kvtier.errors import CacheStateError, InvariantError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.storage.config import StorageWrite
from kvtier.transfer import runs
from kvtier.transfer.submit import Operation

log = logging.getLogger(__name__)


class TierState(StorageTransitions, RankAgreement):
    """The tree, allocators, queues and in-flight transfers of a cache; see the module docstring.

    `storage`: the mover to a third tier below the host (`kvtier.cache.storage_tier`), or None.
    `ranks`: the tensor-parallel ranks whose caches decide together (`kvtier.cache.agreement`;
    None: one process). With several ranks the constructor is a collective.
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
        dspec, hspec = device_pool.spec, host_pool.spec
        if dspec.buffers != hspec.buffers or dspec.page_size != hspec.page_size:
            raise CacheStateError("device and host pools must be built from the same spec")
        cfg = self.config = config or CacheConfig()
        self.spec = dspec
        self.device_pool, self.host_pool = device_pool, host_pool
        self.mover = mover or DeviceHostMover(
            device_pool,
            host_pool,
            costs=cfg.costs,
            kernel=cfg.kernel,
            force=cfg.force_path,
        )
        ps = self.spec.page_size
        self.tree = RadixTree(ps)
        self.device_alloc = HostSlotAllocator(device_pool.num_slots, ps, AllocPolicy.CONTIGUOUS)
        self.host_alloc = HostSlotAllocator(host_pool.num_slots, ps, cfg.host_alloc_policy)
        policy = cfg.eviction.make()
        self.device_queue, self.host_queue = EvictionQueue(policy), EvictionQueue(policy)
        self._held = np.zeros(device_pool.num_slots, dtype=bool)  # device slots held by requests
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._inflight: dict[int, tuple[Transfer, list[Node], LoadHandle | None]] = {}
        # Transfers in submission order per direction (completed ones are skipped when met).
        self._submitted: dict[Direction, deque[Transfer]] = {d: deque() for d in Direction}
        self.metrics = CacheMetrics()
        self.bytes_per_token = self.spec.bytes_per_token()
        self._closed = False
        self._init_storage(storage)
        self._init_ranks(ranks)

    # -- bookkeeping -------------------------------------------------------------------

    def _place(self, n: Node) -> None:
        """Put `n` in the queues of the tiers it is in now, and only those."""
        for queue, member in (
            (self.device_queue, n.state.on_device),
            (self.host_queue, n.state is NodeState.HOST),
        ):
            if member:
                queue.add(n)
            else:
                queue.discard(n)

    def _touch(self, nodes: list[Node], hit: bool) -> None:
        """Mark a path's nodes used now (and hit, for a match); re-rank them in their queues."""
        now = self.tree.tick()
        for n in nodes:
            n.last_access = now
            n.hits += hit
            self.device_queue.touch(n)
            self.host_queue.touch(n)

    def _track(self, transfer: Transfer, nodes: list[Node], handle: LoadHandle | None, d: Direction) -> None:
        self._inflight[id(transfer)] = (transfer, nodes, handle)
        self._submitted[d].append(transfer)

    def _split(self, node: Node, at: int) -> Node:
        head = self.tree.split(node, at)
        if head.transfer is not None and id(head.transfer) in self._inflight:
            self._inflight[id(head.transfer)][1].append(head)
        if head.io is not None and id(head.io) in self._storing:
            self._storing[id(head.io)][1].append(head)
        self._place(head)
        return head

    # -- device ------------------------------------------------------------------------

    def _alloc_device(self, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """`n` device slots and their runs, evicting from the device when short; on every rank or none."""
        got = self.device_alloc.alloc_runs(n)
        if got is None:
            self._evict_device(n - self.device_alloc.available())
            got = self.device_alloc.alloc_runs(n)
        return self._agree_device_alloc(got, n)

    def _evict_from_device(self, n: Node) -> int:
        """Move `n` off the device (backing it up first where the policy wants it); returns tokens freed."""
        if (
            n.state is NodeState.DEVICE
            and self.config.write_policy is not WritePolicy.WRITE_THROUGH_SELECTIVE
        ):
            self._backup(n)
        if n.state is NodeState.BACKING_UP:
            self._complete(n.transfer, wait=True)  # waits for this node's backup only
        tokens = len(n)
        self.device_alloc.free(n.device_slots)
        n.device_slots = None
        self.metrics.device_evictions += 1
        self.metrics.device_evicted_tokens += tokens
        if n.state is NodeState.BOTH:
            n.state = NodeState.HOST
            self._place(n)
            log.debug("evicted %s from the device (host copy kept)", n)
        else:  # no host copy: the node and its (host-only) subtree are gone
            log.debug("evicted %s from the device and dropped it (no host copy)", n)
            self._drop_subtree(n)
        return tokens

    # -- host --------------------------------------------------------------------------

    def _backup(self, n: Node) -> bool:
        """Start copying `n` to the host; False when the host has no room even after eviction."""
        if n.state is not NodeState.DEVICE:
            raise InvariantError(f"backup of {n}: only a device-only node is backed up")
        got = self.host_alloc.alloc_runs(len(n))
        if got is None:
            n.lock += 1  # keep `n` (and so its path) out of the host eviction below
            self._evict_host(len(n) - self.host_alloc.available())
            n.lock -= 1
            got = self.host_alloc.alloc_runs(len(n))
        if got is None:
            self.metrics.backups_skipped += 1
            log.debug("backup of %s skipped: the host is full of locked nodes", n)
            return False
        slots, runs = got
        op = Operation(Direction.BACKUP, (slots,), n.device_slots, (runs, slot_runs(n.device_slots)))
        try:
            transfer = self.mover.submit(op)
        except BaseException:
            self.metrics.failed_submissions += 1
            log.info("backup of %s failed to submit; its host slots are given back", n, exc_info=True)
            self.host_alloc.free(slots)
            raise
        n.host_slots, n.host_runs = slots, runs
        n.state, n.transfer = NodeState.BACKING_UP, transfer
        self._place(n)
        self._track(transfer, [n], None, Direction.BACKUP)
        self.metrics.backups += 1
        self.metrics.bytes_d2h += len(n) * self.bytes_per_token
        return True

    def _drop_from_host(self, n: Node) -> int:
        if self._write_back(n):
            return 0  # freed once storage holds it
        tokens = len(n)
        self.metrics.host_evictions += 1
        self.metrics.host_evicted_tokens += tokens
        self._free_host(n)
        self.tree.remove(n)
        self._place(n)
        log.debug("evicted %s from the host", n)
        return tokens

    def _drop_subtree(self, n: Node) -> None:
        for c in list(n.children.values()):
            self._drop_subtree(c)
        self.metrics.dropped_tokens += len(n)
        self._free_host(n)
        if n.device_slots is not None:
            self.device_alloc.free(n.device_slots)
            n.device_slots = None
        self.tree.remove(n)
        self._place(n)

    def _free_host(self, n: Node) -> None:
        if n.host_slots is not None:
            if n.state is NodeState.BACKING_UP:
                self._complete(n.transfer, wait=True)
            self._await_io(n)
            self.host_alloc.free(n.host_slots)
            n.host_slots = n.host_runs = None

    # -- eviction and completion ------------------------------------------------------

    def _evict_device(self, tokens: int) -> int:
        return _evict(tokens, self.device_queue, self._device_leaf, self._evict_from_device)

    def _evict_host(self, tokens: int) -> int:
        return _evict(tokens, self.host_queue, self._host_leaf, self._drop_from_host)

    @staticmethod
    def _device_leaf(n: Node) -> bool:
        return (
            n.state in (NodeState.DEVICE, NodeState.BACKING_UP, NodeState.BOTH)
            and n.lock == 0
            and not any(c.state.on_device for c in n.children.values())
        )

    @staticmethod
    def _host_leaf(n: Node) -> bool:
        return n.state is NodeState.HOST and n.lock == 0 and not n.children and n.io is None

    def _complete(self, transfer: Transfer | None, wait: bool) -> None:
        """Finish `transfer` (waiting for it with `wait`): its nodes' states, the load's lock."""
        if transfer is None or id(transfer) not in self._inflight:
            return
        if wait:
            transfer.wait()
        _, nodes, handle = self._inflight.pop(id(transfer))
        for n in nodes:
            backed_up = n.state is NodeState.BACKING_UP
            if n.state in (NodeState.BACKING_UP, NodeState.LOADING):
                n.state = NodeState.BOTH
            n.transfer = None
            if (
                backed_up
                and self.storage is not None
                and self.storage.config.write is StorageWrite.WRITE_THROUGH
            ):
                self._store(n)
        if handle is not None:
            handle.done = True
            self.metrics.load_seconds.observe(time.perf_counter() - handle.submitted_at)
            self.tree.lock_path(handle.nodes[-1], -1)


def _evict(tokens: int, queue: EvictionQueue, eligible, evict) -> int:
    """Evict `queue`'s eligible nodes in order until `tokens` are freed; returns the tokens freed."""
    freed = 0
    if tokens <= 0:
        return 0
    for n in queue.candidates(eligible):
        freed += evict(n)
        if freed >= tokens:
            break
    return freed


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """`(first slot, length)` runs of consecutive ids in `slots` (`[n]` int64 CPU), in order."""
    s = slots.numpy()
    first, lens = runs.starts(runs.breaks(s, 1))
    return list(zip(s[first].tolist(), lens.tolist(), strict=True))
