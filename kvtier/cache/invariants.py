"""`check(...)`: the cache's invariants, over its collaborators, each broken one raised as `InvariantError`.

O(cache): for tests and debugging, never on a hot path. What it checks:
- every slot of a tier is free or owned exactly once (by a node, or by a request's hold);
- the allocators agree with the owners; an engine's device tier finds each node on its
  slots (`ExternalDeviceTier.nodes_on`, what `device_freed` reads);
- every node's lock count equals the leases and loads in flight that hold its path;
- each node's host runs describe its host slots, and device residency is closed under
  prefixes;
- the eviction queues hold exactly each tier's nodes, and no node's priority is above
  its parent's in a tier (the rule eviction's cost rests on);
- a node on both tiers holds identical bytes in both (`compare_bytes`);
- each node's state fits its slots and what is in flight: device slots exactly when
  `on_device`, host slots exactly when `on_host`, a transfer exactly when `backing_up*` or
  `loading*`, a fetch the storage tier tracks exactly when `fetching` (a locked leaf), a
  store it tracks exactly when `*_storing`; stored states only with a storage tier; page
  hashes count the node's pages.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.cache.compose import CacheParts
from kvtier.cache.handles import Lease
from kvtier.cache.radix import Node, NodeState
from kvtier.cache.tiers import ExternalDeviceTier
from kvtier.errors import InvariantError
from kvtier.pool.rows import as_words


def _require(ok: object, message: str) -> None:
    if not ok:
        raise InvariantError(message)


def check(c: CacheParts, leases: list[Lease], compare_bytes: bool = True) -> None:
    """Raise `InvariantError` naming the first broken invariant."""
    if c.device.allocator is not None:  # (none where the engine owns the device)
        c.device.allocator.check_invariants()
    c.host.allocator.check_invariants()
    nodes = c.tree.nodes()
    for n in nodes:
        _check_node(c, n, c.tree.page_size)
    _check_owners(c, nodes)
    _check_locks(c, leases, nodes)
    _check_queues(c, nodes)
    _check_storage(c, nodes)
    if compare_bytes:
        for n in nodes:
            if n.state.both:
                _check_same_bytes(c, n)


def _check_owners(c: CacheParts, nodes: list[Node]) -> None:
    device_owner = np.zeros(c.device_pool.num_slots, dtype=np.int64)
    host_owner = np.zeros(c.host_pool.num_slots, dtype=np.int64)
    for n in nodes:
        if n.device_slots is not None:
            np.add.at(device_owner, n.device_slots.numpy(), 1)
        if n.host_slots is not None:
            np.add.at(host_owner, n.host_slots.numpy(), 1)
    held = np.zeros(c.device_pool.num_slots, dtype=bool)
    held[c.device.held_slots()] = True
    _require(not (held & (device_owner > 0)).any(), "a device slot is both held by a request and in the tree")
    owned = device_owner + held
    _require(owned.max(initial=0) <= 1, "a device slot is owned twice")
    _require(
        c.device.allocator is None or (owned.astype(bool) == c.device.allocator.allocated_mask()).all(),
        "device allocator disagrees with owners",
    )
    if isinstance(c.device, ExternalDeviceTier):
        for n in nodes:
            if n.device_slots is not None:
                found = c.device.nodes_on(n.device_slots.numpy())
                _require(found == [(n, 0)], f"{n}: the engine's device tier finds {found} on its slots")
    _require(host_owner.max(initial=0) <= 1, "a host slot is owned by two nodes")
    _require(
        (host_owner.astype(bool) == c.host.allocator.allocated_mask()).all(),
        "host allocator disagrees with owners",
    )


def _check_locks(c: CacheParts, leases: list[Lease], nodes: list[Node]) -> None:
    expected = {n.id: 0 for n in nodes}
    holders = [lease.node for lease in leases]
    holders += [h.nodes[-1] for _, _, h in c.moves.inflight.records() if h is not None]
    for node in holders:
        for n in node.path():
            expected[n.id] = expected.get(n.id, 0) + 1
    for n in nodes:
        _require(n.lock == expected[n.id], f"{n}: lock {n.lock}, leases and loads say {expected[n.id]}")


def _check_queues(c: CacheParts, nodes: list[Node]) -> None:
    for t in (c.device, c.host):
        queue, tier = t.queue, t.name
        want = {n.id for n in nodes if t.holds(n)}
        have = {n.id for n in queue.nodes()}
        _require(want == have, f"the {tier} queue holds {sorted(have ^ want)[:10]} wrongly")
        for n in queue.nodes():
            p = n.parent
            if p is not None and p in queue:
                rank, parent_rank = queue.policy.priority(n), queue.policy.priority(p)
                _require(parent_rank >= rank, f"{n} ranks {rank} above its parent's {parent_rank} ({tier})")


def _check_storage(c: CacheParts, nodes: list[Node]) -> None:
    st = c.storage
    fetching = {id(node) for _, node, _ in st.fetching()} if st is not None else set()
    storing = {id(n) for _, group in st.storing() for n in group} if st is not None else set()
    for n in nodes:
        s = n.state
        if n.page_hashes is not None:
            _require(len(n.page_hashes) * c.tree.page_size == len(n), f"{n}: page hashes for another length")
        _require(st is not None or not (s.stored or s.storing), f"{n}: {s.value} with no storage tier")
        tracked = id(n) in fetching
        _require((s is NodeState.FETCHING) == tracked, f"{n}: {s.value}, a fetch tracked: {tracked}")
        if s is NodeState.FETCHING:
            _require(n.lock > 0 and not n.children, f"{n}: a fetching node must be a locked leaf")
            _require(n.page_hashes is not None, f"{n}: fetched without its page hashes")
        on_record = id(n) in storing and st.store_of(n) is not None
        _require(s.storing == on_record, f"{n}: {s.value}, a store tracked: {on_record}")


def _check_node(c: CacheParts, n: Node, ps: int) -> None:
    _require(n.state is not NodeState.DROPPED, f"{n} is dropped but still in the tree")
    _require(len(n.key) > 0 and len(n.key) % ps == 0, f"{n}: key of {len(n.key)} tokens")
    _require(n.parent is not None, f"{n}: no parent")
    _require(n.parent.children.get(c.tree.page_key(n.key)) is n, f"{n}: parent link broken")
    if n.state.on_device:
        _require(n.device_slots is not None and len(n.device_slots) == len(n), f"{n}: device slots")
        _require(n.parent.is_root or n.parent.state.on_device, f"{n} on the device under a node that is not")
    else:
        _require(n.device_slots is None, f"{n}: device slots on a host-only node")
    if n.state.on_host:
        _require(n.host_slots is not None and len(n.host_slots) == len(n), f"{n}: host slots")
        runs = [s for start, k in n.host_runs for s in range(start, start + k)]
        _require(runs == n.host_slots.tolist(), f"{n}: host runs do not describe its host slots")
    else:
        _require(n.host_slots is None, f"{n}: host slots on a device-only node")
    in_flight = n.state.backing_up or n.state.loading
    _require((n.transfer is not None) == in_flight, f"{n}: transfer {n.transfer} in state {n.state}")


def _check_same_bytes(c: CacheParts, n: Node) -> None:
    for b in c.device_pool.spec.buffers:
        for layer in b.layers:
            dev = as_words(c.device_pool.layer(b.name, layer))[n.device_slots.to(c.device_pool.device)].cpu()
            host = as_words(c.host_pool.gather(b.name, layer, n.host_slots))
            _require(torch.equal(dev, host), f"{n}: host and device bytes differ ({b.name}, layer {layer})")
