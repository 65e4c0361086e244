"""`check(controller)`: the cache's invariants, asserted (O(cache); tests and debugging only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.cache.radix import Node, NodeState
from kvtier.pool.rows import as_words

if TYPE_CHECKING:
    from kvtier.cache.controller import CacheController


def check(c: CacheController, compare_bytes: bool = True) -> None:
    """Raise AssertionError naming the first broken invariant."""
    c.device_alloc.check_invariants()
    c.host_alloc.check_invariants()
    nodes = c.tree.nodes()
    ps = c.spec.page_size
    device_owner = np.zeros(c.device_pool.num_slots, dtype=np.int64)
    host_owner = np.zeros(c.host_pool.num_slots, dtype=np.int64)
    expected_lock: dict[int, int] = {n.id: 0 for n in nodes}
    for n in nodes:
        _check_node(c, n, ps)
        if n.device_slots is not None:
            np.add.at(device_owner, n.device_slots.numpy(), 1)
        if n.host_slots is not None:
            np.add.at(host_owner, n.host_slots.numpy(), 1)
    held = c._held
    assert not (held & (device_owner > 0)).any(), "a device slot is both held by a request and in the tree"
    owned = device_owner + held
    assert owned.max(initial=0) <= 1, "a device slot is owned twice"
    assert (owned.astype(bool) == c.device_alloc.allocated_mask()).all(), (
        "device allocator disagrees with owners"
    )
    assert host_owner.max(initial=0) <= 1, "a host slot is owned by two nodes"
    assert (host_owner.astype(bool) == c.host_alloc.allocated_mask()).all(), (
        "host allocator disagrees with owners"
    )

    holders = [lease.node for lease in c._leases.values()]
    holders += [h.nodes[-1] for _, _, h in c._inflight.values() if h is not None]
    for node in holders:
        for n in node.path():
            expected_lock[n.id] = expected_lock.get(n.id, 0) + 1
    for n in nodes:
        assert n.lock == expected_lock[n.id], f"{n}: lock {n.lock}, leases say {expected_lock[n.id]}"
        assert n.lock >= 0
    if compare_bytes:
        for n in nodes:
            if n.state is NodeState.BOTH:
                _check_same_bytes(c, n)


def _check_node(c: CacheController, n: Node, ps: int) -> None:
    assert n.state is not NodeState.DROPPED, f"{n} is dropped but still in the tree"
    assert len(n.key) > 0 and len(n.key) % ps == 0, f"{n}: key of {len(n.key)} tokens"
    assert n.parent is not None, f"{n}: no parent"
    assert n.parent.children.get(c.tree.page_key(n.key)) is n, f"{n}: parent link broken"
    if n.state.on_device:
        assert n.device_slots is not None and len(n.device_slots) == len(n), f"{n}: device slots"
        assert n.parent.is_root or n.parent.state.on_device, f"{n} on the device under a node that is not"
    else:
        assert n.device_slots is None, f"{n}: device slots on a host-only node"
    if n.state.on_host:
        assert n.host_slots is not None and len(n.host_slots) == len(n), f"{n}: host slots"
        runs = [s for start, k in n.host_runs for s in range(start, start + k)]
        assert runs == n.host_slots.tolist(), f"{n}: host runs do not describe its host slots"
    else:
        assert n.host_slots is None, f"{n}: host slots on a device-only node"
    in_flight = n.state in (NodeState.BACKING_UP, NodeState.LOADING)
    assert (n.signal is not None) == in_flight, f"{n}: signal {n.signal} in state {n.state}"


def _check_same_bytes(c: CacheController, n: Node) -> None:
    for b in c.spec.buffers:
        for layer in b.layers:
            dev = as_words(c.device_pool.layer(b.name, layer))[n.device_slots.to(c.device_pool.device)].cpu()
            host = as_words(c.host_pool.gather(b.name, layer, n.host_slots))
            assert torch.equal(dev, host), f"{n}: host and device bytes differ ({b.name}, layer {layer})"
