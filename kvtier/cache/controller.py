"""The tiered prefix cache a serving engine drives: match, load back, insert, release, evict.

`CacheController` owns the radix tree, both pools' slot allocators, the load and
backup lanes (streams) and every signal (event) in flight, so callers never touch
streams. Its contract:

- `match(tokens)` finds the longest cached prefix: the part on the device (its
  slots, ready to read) and the part only on the host (nodes to `load_back`).
- `acquire(match)` locks the matched path for a request; `release(lease)` unlocks it
  (once). Locked nodes are never evicted, from either tier.
- `load_back(match)` allocates device slots (contiguous where possible), builds one
  transfer plan for every buffer of those tokens, submits every layer on the load
  lane and returns a `LoadHandle`: `wait_layer(i)` makes the current stream wait for
  layer i only (an event, not a host sync).
- `alloc_device(n)` hands a request device slots for new tokens (evicting when
  short); `insert(tokens, slots)` gives them to the tree; `free_device(slots)` returns
  slots a request did not insert.
- Write policies decide when device nodes are copied to the host: at insert
  (`write_through`), after `selective_hits` hits (`write_through_selective`) or when
  evicted from the device (`write_back`). A node counts as backed up only when its
  backup's signal has fired.
- `check_invariants()` asserts every slot is free or owned once per tier, lock counts
  match the leases, and backed-up nodes hold identical bytes in both tiers.

Errors (`SlotError`, `LeaseError`, `CacheStateError`, `CacheFullError`) are raised
before anything changes.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.cache.radix import Node, NodeState, RadixTree
from kvtier.cache.streams import Lane, Signal, make_lane
from kvtier.errors import CacheFullError, CacheStateError, LeaseError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.transfer import (
    KernelOptions,
    PathCosts,
    TransferPath,
    TransferPlan,
    backup,
    load_layers,
    native,
)
from kvtier.transfer.native import loop_takes, run_buffers, run_layers
from kvtier.transfer.plan import Planner
from kvtier.transfer.runs import RunPair

log = logging.getLogger(__name__)


class WritePolicy(str, Enum):
    """When device nodes are copied to the host."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclass(frozen=True)
class CacheConfig:
    """Policies of a `CacheController`.

    `recompute_below`: host hits shorter than this many tokens are not loaded back;
    the handle says to recompute them. `force_path`: one transfer path for every load
    and backup instead of the planner's (benchmarks use `reference` for a stock-style
    configuration). `layers_per_load`: layers a reload through the kernel moves per
    call, each layer's signal then set when its group has landed (copy-engine reloads
    go layer by layer); more than one lets the kernel read `page_first` pages of
    several layers as one stretch (fully scattered DSA indexer rows at page 1: 0.53 of
    the line rate one layer at a time, 0.80-0.83 in groups of 16-78 on an H200), at the
    cost of layer i waiting for its whole group.
    """

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    recompute_below: int = 0
    host_alloc_policy: AllocPolicy = AllocPolicy.CONTIGUOUS
    costs: PathCosts = field(default_factory=PathCosts)
    kernel: KernelOptions = field(default_factory=KernelOptions)
    force_path: TransferPath | None = None
    layers_per_load: int = 1


@dataclass
class Match:
    """The longest cached prefix of some tokens.

    `device_slots`: `[device_tokens]` int64 CPU, the resident part, readable now.
    `host_nodes`: the nodes after it that are only on the host (`load_back` them).
    """

    tokens: int
    device_tokens: int
    device_slots: torch.Tensor
    device_nodes: list[Node]
    host_nodes: list[Node]
    last_node: Node

    @property
    def host_tokens(self) -> int:
        return self.tokens - self.device_tokens


@dataclass(eq=False)
class Lease:
    """A request's lock on a path of the tree (from the root to `node`)."""

    id: int
    node: Node
    released: bool = False


@dataclass(eq=False)
class LoadHandle:
    """A load back in flight.

    `device_slots`: `[tokens]` int64 CPU, where the loaded tokens land (valid for
    layer i after `wait_layer(i)`). `recompute`: nothing was loaded; the caller
    recomputes these tokens instead.
    """

    nodes: list[Node]
    tokens: int
    device_slots: torch.Tensor
    layer_signals: Sequence[Signal]
    recompute: bool = False
    plan_source: TransferPlan | Callable[[], TransferPlan] | None = None
    submitted_at: float = 0.0
    submit_s: float = 0.0
    done: bool = False

    @property
    def plan(self) -> TransferPlan | None:
        """The load's transfer plan (built when first asked for where the load went out from its runs
        alone: the cache's own reloads do not need the plan's per-run objects)."""
        if callable(self.plan_source):
            self.plan_source = self.plan_source()
        return self.plan_source

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer `layer` is loaded (no host wait on CUDA)."""
        if self.layer_signals:
            self.layer_signals[layer].make_current_wait()

    def wait(self) -> None:
        """Block the host until every layer is loaded."""
        if self.layer_signals:
            self.layer_signals[-1].wait_host()


@dataclass
class CacheMetrics:
    """Counters since the controller was built (bytes are KV bytes over all layers)."""

    matches: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    backups: int = 0
    backups_skipped: int = 0
    device_evictions: int = 0
    device_evicted_tokens: int = 0
    host_evictions: int = 0
    host_evicted_tokens: int = 0
    dropped_tokens: int = 0
    load_submit_s: float = 0.0
    load_s: list[float] = field(default_factory=list)


class CacheController:
    """The tiered radix cache over `device_pool` and `host_pool` (same spec); see the module docstring."""

    def __init__(
        self, device_pool: DevicePool, host_pool: HostPool, config: CacheConfig | None = None
    ) -> None:
        if (
            device_pool.spec.buffers != host_pool.spec.buffers
            or device_pool.spec.page_size != host_pool.spec.page_size
        ):
            raise CacheStateError("device and host pools must be built from the same spec")
        self.config = config or CacheConfig()
        if (
            self.config.selective_hits < 1
            or self.config.recompute_below < 0
            or self.config.layers_per_load < 1
        ):
            raise CacheStateError(f"bad cache config {self.config}")
        self.spec = device_pool.spec
        self.device_pool, self.host_pool = device_pool, host_pool
        # The transfer options, checked now; every plan of this cache reuses what it works out once.
        cfg = self.config
        self._planner = Planner(host_pool, device_pool, cfg.costs, cfg.kernel, cfg.force_path)
        ps = self.spec.page_size
        self.tree = RadixTree(ps)
        self.device_alloc = HostSlotAllocator(device_pool.num_slots, ps, AllocPolicy.CONTIGUOUS)
        self.host_alloc = HostSlotAllocator(host_pool.num_slots, ps, self.config.host_alloc_policy)
        self.load_lane: Lane = make_lane(device_pool.device)
        self.backup_lane: Lane = make_lane(device_pool.device)
        # The compiled loop is built (or found in the cache) now, not inside the first transfer.
        cuda = device_pool.device.type == "cuda" and native.library() is not None
        self._run_buffers = run_buffers(host_pool, device_pool) if cuda else None
        self._held = np.zeros(device_pool.num_slots, dtype=bool)  # device slots held by requests
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._inflight: dict[int, tuple[Signal, list[Node], LoadHandle | None]] = {}
        self.metrics = CacheMetrics()
        self.bytes_per_token = self.spec.bytes_per_token()

    # -- queries -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | torch.Tensor | np.ndarray) -> Match:
        """The longest cached prefix of `tokens` (whole pages); counts hits, refreshes LRU order.

        `tokens`: `[n]` integer ids; an int32 or int64 array or CPU tensor is matched without a
        copy. Keys keep the dtype they were inserted with: ids held as int32 compare half the
        bytes of int64 (a cold 128k-token match is bound by memory), and a caller should keep
        one dtype (int32 keys against int64 ids compare correctly but cast as they go, slower).
        """
        self.poll()
        key = self.tree.whole_pages(token_ids(tokens))
        nodes, _, partial, shared = self.tree.walk(key)
        if partial is not None:
            nodes.append(self._split(partial, shared))
        for n in nodes:
            if n.state is NodeState.LOADING:
                self._complete(n.signal, wait=True)
        device_nodes: list[Node] = []
        for n in nodes:
            if not n.state.on_device:
                break
            device_nodes.append(n)
        host_nodes = nodes[len(device_nodes) :]
        assert all(n.state is NodeState.HOST for n in host_nodes)
        now = self.tree.tick()
        for n in nodes:
            n.last_access = now
            n.hits += 1
        device_tokens = sum(len(n) for n in device_nodes)
        matched = device_tokens + sum(len(n) for n in host_nodes)
        m = self.metrics
        m.matches += 1
        m.device_hit_tokens += device_tokens
        m.host_hit_tokens += matched - device_tokens
        m.miss_tokens += len(tokens) - matched
        if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for n in device_nodes:
                if n.state is NodeState.DEVICE and n.hits >= self.config.selective_hits:
                    self._backup(n)
        slots = [n.device_slots for n in device_nodes]
        return Match(
            tokens=matched,
            device_tokens=device_tokens,
            device_slots=_concat(slots),
            device_nodes=device_nodes,
            host_nodes=host_nodes,
            last_node=nodes[-1] if nodes else self.tree.root,
        )

    # -- locks -------------------------------------------------------------------------

    def acquire(self, match: Match | Node) -> Lease:
        """Lock the path to the match's last node for a request."""
        node = match.last_node if isinstance(match, Match) else match
        if node.state is NodeState.DROPPED:
            raise CacheStateError(f"{node} was evicted; match again")
        lease = Lease(next(self._lease_ids), node)
        self.tree.lock_path(node, +1)
        self._leases[lease.id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        """Unlock a lease's path; a lease is released once."""
        if lease.released or self._leases.get(lease.id) is not lease:
            raise LeaseError(f"lease {lease.id} is not held (released twice, or not from this cache)")
        lease.released = True
        del self._leases[lease.id]
        self.tree.lock_path(lease.node, -1)

    # -- device slots for requests -----------------------------------------------------

    def alloc_device(self, n: int) -> torch.Tensor:
        """`[n]` device slots for a request's new tokens, evicting from the device when short."""
        if n % self.spec.page_size or n < 0:
            raise SlotError(f"alloc_device({n}): not a whole number of pages of {self.spec.page_size}")
        if n == 0:
            return _NO_SLOTS
        slots, _ = self._alloc_device(n)
        self._held[slots.numpy()] = True
        return slots

    def free_device(self, slots: torch.Tensor) -> None:
        """Return device slots a request holds and did not insert."""
        s = self._check_slots(slots, self.device_pool.num_slots, "slots")
        not_held = s[~self._held[s]]
        if len(not_held):
            raise SlotError(f"free_device: slots {not_held[:10].tolist()} are not held by a request")
        self.device_alloc.free(torch.from_numpy(s))
        self._held[s] = False

    # -- insert ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int] | torch.Tensor | np.ndarray, device_slots: torch.Tensor) -> Node:
        """Give the tree a request's tokens (whole pages) and the device slots their KV is in.

        `device_slots`: `[len(tokens)]` int64 CPU. Positions the tree already holds
        on the device keep the tree's slots; the caller's slots there (if different)
        are freed. Host-only positions take the caller's slots (the host copy is
        dropped). Every other slot must be held by the caller (`alloc_device`).
        Returns the deepest node of `tokens`.
        """
        self.poll()
        key = token_ids(tokens, copy=True)
        key.flags.writeable = False
        ps = self.spec.page_size
        if len(key) % ps:
            raise SlotError(f"insert: {len(key)} tokens is not a whole number of pages of {ps}")
        s = self._check_slots(device_slots, self.device_pool.num_slots, "device_slots")
        if len(s) != len(key):
            raise SlotError(f"insert: {len(key)} tokens but {len(s)} device slots")
        if len(np.unique(s)) != len(s):
            raise SlotError("insert: device_slots repeat ids")
        nodes, pos, partial, shared = self.tree.walk(key)
        # Validate everything before changing anything.
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
            raise SlotError(f"insert: device slots {bad[:10].tolist()} are not held by the caller")

        if partial is not None:
            nodes.append(self._split(partial, shared))
        now = self.tree.tick()
        redundant: list[np.ndarray] = []
        adopted: list[Node] = []
        at = 0
        for n in nodes:
            mine = s[at : at + len(n)]
            if n.state.on_device:
                if not (n.device_slots.numpy() == mine).all():
                    redundant.append(mine)
            else:  # host only: take the caller's fresh KV, drop the host copy
                self._free_host(n)
                n.device_slots = torch.from_numpy(mine.copy())
                n.state = NodeState.DEVICE
                self._held[mine] = False
                adopted.append(n)
            n.last_access = now
            at += len(n)
        for r in redundant:
            self.device_alloc.free(torch.from_numpy(r))
            self._held[r] = False
        last = nodes[-1] if nodes else self.tree.root
        if covered < len(key):
            new = s[covered:]
            last = self.tree.add_child(last, key[covered:], torch.from_numpy(new.copy()))
            self._held[new] = False
            adopted.append(last)
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            for n in adopted:
                self._backup(n)
        return last

    # -- load back ---------------------------------------------------------------------

    def load_back(self, match: Match) -> LoadHandle:
        """Bring the match's host-only nodes to the device; returns a handle with per-layer readiness."""
        self.poll()
        nodes = list(match.host_nodes)
        for n in nodes:
            if n.state is not NodeState.HOST:
                raise CacheStateError(f"load_back: {n} is not host-only (evicted, loading or resident)")
        for a, b in itertools.pairwise(nodes):
            if b.parent is not a:
                raise CacheStateError("load_back: the nodes are not one path")
        if nodes and nodes[0].parent is not self.tree.root and not nodes[0].parent.state.on_device:
            raise CacheStateError(f"load_back: the parent of {nodes[0]} is not on the device")
        total = sum(len(n) for n in nodes)
        if total == 0:
            return LoadHandle([], 0, _NO_SLOTS, [], done=True)
        if total < self.config.recompute_below:
            self.metrics.recomputed_tokens += total
            return LoadHandle(nodes, total, _NO_SLOTS, [], recompute=True, done=True)

        t0 = time.perf_counter()
        self.tree.lock_path(nodes[-1], +1)  # nothing on the path is evicted while it loads
        try:
            dev, dev_runs = self._alloc_device(total)
        except CacheFullError:
            self.tree.lock_path(nodes[-1], -1)
            raise
        # Both sides are allocator pages (host: from backups, device: just allocated).
        runs = _runs_of(nodes, dev_runs)
        make_plan = functools.partial(
            self._plan, Direction.LOAD, [n.host_slots for n in nodes], dev, whole_pages=True, runs=runs
        )
        try:
            signals = self._copy_runs(Direction.LOAD, total, runs, per_layer=True)
            plan: TransferPlan | Callable[[], TransferPlan] = make_plan  # built when read
            if signals is None:
                plan = make_plan()
                signals = self._submit(plan, self.load_lane, per_layer=True)
        except BaseException:
            self._abandon(self.load_lane, self.device_alloc, dev)
            self.tree.lock_path(nodes[-1], -1)
            raise
        at = 0
        for n in nodes:
            n.device_slots = dev if len(nodes) == 1 else dev[at : at + len(n)]
            n.state = NodeState.LOADING
            n.signal = signals[-1]
            at += len(n)
        handle = LoadHandle(nodes, total, dev, signals, plan_source=plan, submitted_at=t0)
        handle.submit_s = time.perf_counter() - t0
        self._inflight[id(signals[-1])] = (signals[-1], list(nodes), handle)
        m = self.metrics
        m.loads += 1
        m.loaded_tokens += total
        m.bytes_h2d += total * self.bytes_per_token
        m.load_submit_s += handle.submit_s
        return handle

    # -- eviction ----------------------------------------------------------------------

    def evict_device(self, tokens: int) -> int:
        """Free at least `tokens` device slots from least-recently-used unlocked leaves; returns freed."""
        return self._evict_lru(tokens, self._device_leaf, self._evict_from_device)

    def evict_host(self, tokens: int) -> int:
        """Free at least `tokens` host slots from least-recently-used unlocked host-only leaves."""
        return self._evict_lru(tokens, self._host_leaf, self._drop_from_host)

    def _evict_lru(self, tokens: int, is_leaf: Callable[[Node], bool], evict: Callable[[Node], int]) -> int:
        """Evict leaves oldest first until `tokens` are freed; a parent left a leaf joins the queue."""
        freed = 0
        heap = [(n.last_access, n.id, n) for n in self.tree.nodes() if is_leaf(n)]
        heapq.heapify(heap)
        while heap and freed < tokens:
            _, _, n = heapq.heappop(heap)
            if not is_leaf(n):
                continue
            parent = n.parent
            freed += evict(n)
            if parent is not None and is_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _drop_from_host(self, n: Node) -> int:
        tokens = len(n)
        self.metrics.host_evictions += 1
        self.metrics.host_evicted_tokens += tokens
        self._free_host(n)
        self.tree.remove(n)
        return tokens

    # -- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Complete every transfer whose signal has fired (no waiting)."""
        for key, (signal, _, _) in list(self._inflight.items()):
            if key in self._inflight and signal.query():
                self._complete(signal, wait=False)

    def flush(self) -> None:
        """Wait for every transfer in flight and complete it (tests, shutdown)."""
        self.load_lane.drain()
        self.backup_lane.drain()
        for signal, _, _ in list(self._inflight.values()):
            self._complete(signal, wait=True)

    # -- internals ---------------------------------------------------------------------

    def _complete(self, signal: Signal | None, wait: bool) -> None:
        if signal is None or id(signal) not in self._inflight:
            return
        if wait:
            signal.wait_host()
        _, nodes, handle = self._inflight.pop(id(signal))
        for n in nodes:
            if n.state in (NodeState.BACKING_UP, NodeState.LOADING):
                n.state = NodeState.BOTH
            n.signal = None
        if handle is not None:
            handle.done = True
            self.metrics.load_s.append(time.perf_counter() - handle.submitted_at)
            self.tree.lock_path(handle.nodes[-1], -1)

    def _split(self, node: Node, at: int) -> Node:
        head = self.tree.split(node, at)
        if head.signal is not None and id(head.signal) in self._inflight:
            self._inflight[id(head.signal)][1].append(head)
        return head

    def _device_leaf(self, n: Node) -> bool:
        return (
            n.state in (NodeState.DEVICE, NodeState.BACKING_UP, NodeState.BOTH)
            and n.lock == 0
            and not any(c.state.on_device for c in n.children.values())
        )

    def _host_leaf(self, n: Node) -> bool:
        return n.state is NodeState.HOST and n.lock == 0 and not n.children

    def _evict_from_device(self, n: Node) -> int:
        """Move `n` off the device (backing it up first where the policy wants it); returns tokens freed."""
        if (
            n.state is NodeState.DEVICE
            and self.config.write_policy is not WritePolicy.WRITE_THROUGH_SELECTIVE
        ):
            self._backup(n)
        if n.state is NodeState.BACKING_UP:
            self._complete(n.signal, wait=True)  # waits for this node's backup only
        tokens = len(n)
        self.device_alloc.free(n.device_slots)
        n.device_slots = None
        self.metrics.device_evictions += 1
        self.metrics.device_evicted_tokens += tokens
        if n.state is NodeState.BOTH:
            n.state = NodeState.HOST
        else:  # no host copy: the node and its (host-only) subtree are gone
            self._drop_subtree(n)
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

    def _backup(self, n: Node) -> bool:
        """Start copying `n` to the host; False when the host has no room even after eviction."""
        assert n.state is NodeState.DEVICE
        got = self.host_alloc.alloc_runs(len(n))
        if got is None:
            n.lock += 1  # keep `n` (and so its path) out of the host eviction below
            self.evict_host(len(n) - self.host_alloc.available())
            n.lock -= 1
            got = self.host_alloc.alloc_runs(len(n))
        if got is None:
            self.metrics.backups_skipped += 1
            return False
        slots, runs = got
        try:
            plan = self._plan(Direction.BACKUP, slots, n.device_slots)
            (signal,) = self._submit(plan, self.backup_lane, per_layer=False)
        except BaseException:
            self._abandon(self.backup_lane, self.host_alloc, slots)
            raise
        n.host_slots, n.host_runs = slots, runs
        n.state = NodeState.BACKING_UP
        n.signal = signal
        self._inflight[id(signal)] = (signal, [n], None)
        self.metrics.backups += 1
        self.metrics.bytes_d2h += len(n) * self.bytes_per_token
        return True

    def _lane(self, direction: Direction) -> Lane:
        return self.load_lane if direction is Direction.LOAD else self.backup_lane

    def _plan(
        self,
        direction: Direction,
        host: torch.Tensor | list[torch.Tensor],
        dev: torch.Tensor,
        whole_pages: bool = False,
        runs: RunPair | None = None,
    ) -> TransferPlan:
        """Plan one operation on this cache's pools with its options. `host`, `dev`: `[n]` int64
        CPU slots from this cache's allocators and tree (`host` may come as the nodes' slots, in
        order); `whole_pages`, `runs`: what is known of them (see `Planner.plan_allocated`)."""
        host = _concat(host) if isinstance(host, list) else host
        stream = self._lane(direction).stream
        if whole_pages:
            return self._planner.plan_allocated(direction, host, dev, runs=runs, stream=stream)
        return self._planner.plan(direction, host, dev, stream=stream)

    def _copy_runs(
        self,
        direction: Direction,
        n: int,
        runs: RunPair | None,
        per_layer: bool,
    ) -> Sequence[Signal] | None:
        """Submit an operation of `n` slots given as `runs` from the compiled loop, planned from the
        runs alone, after the compute stream's queued work; its signals as `_submit`'s. None,
        with nothing submitted, where the planner moves some row another way than by the copy
        engine, the loop cannot take the runs (`copy.loop_takes`), or there is no loop here."""
        lib = native.library() if self._run_buffers is not None else None
        if runs is None or lib is None:
            return None
        copies = self._planner.copies(n, runs)
        if copies is None or not loop_takes(lib, copies):
            return None
        lane = self._lane(direction)
        stream = lane.stream.cuda_stream
        submit = functools.partial(run_layers, lib, copies, self._run_buffers, direction, stream)
        return lane.run_native(submit, self.spec.num_layers if per_layer else 1)

    def _submit(self, plan: TransferPlan, lane: Lane, per_layer: bool) -> Sequence[Signal]:
        """Every layer of `plan` on `lane` through the plan executor, after the compute stream's
        queued work."""
        stream = lane.stream
        self._after_compute(lane)
        if plan.direction is Direction.LOAD:
            size = self.config.layers_per_load
            layers = self.spec.num_layers
            groups = [range(lo, min(lo + size, layers)) for lo in range(0, layers, size)]
            jobs = [
                functools.partial(load_layers, plan, self.host_pool, self.device_pool, g, stream)
                for g in groups
            ]
            if per_layer:  # each layer's signal: its group's
                return [s for g, s in zip(groups, lane.run_each(jobs), strict=True) for _ in g]
        elif per_layer:
            jobs = [
                functools.partial(backup, plan, self.device_pool, self.host_pool, [layer], stream)
                for layer in range(self.spec.num_layers)
            ]
        else:  # one call: page_first kernel rows of every layer move together
            jobs = [functools.partial(backup, plan, self.device_pool, self.host_pool, None, stream)]
        if per_layer:
            return lane.run_each(jobs)
        for job in jobs:
            lane.submit(job)
        return [lane.signal()]

    @staticmethod
    def _abandon(lane: Lane, alloc: HostSlotAllocator, slots: torch.Tensor) -> None:
        """Undo a transfer whose submission failed: let the lane finish what it already took (it may
        write `slots`), then give `slots` back; the tree stays as it was before the call."""
        try:
            lane.drain()
        finally:
            alloc.free(slots)

    def _free_host(self, n: Node) -> None:
        if n.host_slots is not None:
            if n.state is NodeState.BACKING_UP:
                self._complete(n.signal, wait=True)
            self.host_alloc.free(n.host_slots)
            n.host_slots = n.host_runs = None

    def _alloc_device(self, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """`n` device slots and their runs, evicting from the device when short."""
        got = self.device_alloc.alloc_runs(n)
        if got is None:
            self.evict_device(n - self.device_alloc.available())
            got = self.device_alloc.alloc_runs(n)
        if got is None:
            raise CacheFullError(
                f"{n} device slots needed, {self.device_alloc.available()} free after evicting every "
                "unlocked node"
            )
        return got

    def _after_compute(self, lane: Lane) -> None:
        """Order the lane after the work already queued on the current compute stream."""
        if self.device_pool.device.type == "cuda":
            lane.wait_for_current()

    @staticmethod
    def _check_slots(slots: torch.Tensor, limit: int, name: str) -> np.ndarray:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.is_floating_point():
            raise SlotError(f"{name} must be a 1-D integer tensor")
        if slots.device.type != "cpu":
            raise SlotError(f"{name} must be on the CPU, got {slots.device}")
        s = slots.to(torch.int64).numpy()
        bad = s[(s < 0) | (s >= limit)]
        if len(bad):
            raise SlotError(f"{name} has ids outside [0, {limit}): {bad[:10].tolist()}")
        return s

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
        """Assert the cache's invariants (O(cache); for tests and debugging). See the module docstring."""
        from kvtier.cache.invariants import check

        check(self, compare_bytes)


def _runs_of(nodes: list[Node], dev_runs: list[tuple[int, int]]) -> RunPair | None:
    """`(host runs, device runs)` of a load of `nodes`, or None where a node lacks its runs."""
    if any(n.host_runs is None for n in nodes):
        return None
    return [r for n in nodes for r in n.host_runs], dev_runs


# No slots, shared (a tensor of zero elements holds nothing to write): making one costs
# ~20 us on the H200 host, twice per reload.
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


def _concat(slots: list[torch.Tensor]) -> torch.Tensor:
    """`[n]` int64 CPU slots of several nodes in order, without a copy for one node.

    numpy, not `torch.cat`: on the H200 host `torch.cat` of one 131072-slot tensor
    took 1.2 ms of the reload's submission (numpy: tens of microseconds).
    """
    if len(slots) == 1:
        return slots[0]
    if not slots:
        return _NO_SLOTS
    return torch.from_numpy(np.concatenate([s.numpy() for s in slots]))


def token_ids(tokens: Sequence[int] | torch.Tensor | np.ndarray, copy: bool = False) -> np.ndarray:
    """Token ids as a `[n]` int32 or int64 array; SlotError unless they are 1-D integers.

    int32 and int64 arrays and CPU tensors pass without a copy (unless `copy`) and keep
    their dtype, other integers become int64; a list costs about 10 ns per id. Keys are
    compared as arrays, so matching a 131072-token prompt is one vectorised comparison
    instead of 131072 Python int comparisons.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.array(tokens, copy=copy) if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise SlotError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise SlotError(f"tokens must be integer ids, got {arr.dtype}")
    if arr.dtype in (np.int32, np.int64):
        return arr
    return arr.astype(np.int64)
