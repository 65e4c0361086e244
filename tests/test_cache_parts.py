"""The cache's collaborators one at a time: tiers, transfers in flight, rank agreement, node moves,
insert checks and the storage tier, each driven directly (CPU pools, deferred lanes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.cache import CacheConfig
from kvtier.cache.agreement import RankAgreement, _cut
from kvtier.cache.compose import classic_tiers, compose_tiers
from kvtier.cache.inflight import InFlight
from kvtier.cache.insert import check_insert
from kvtier.cache.policy import LRU
from kvtier.cache.states import NodeState
from kvtier.cache.storage_mover import LookupPages, open_storage
from kvtier.cache.tiers import DeviceTier
from kvtier.errors import CacheFullError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint

PS = 2


def parts(device: int = 16, host: int = 16, storage: StorageConfig | None = None, **cfg):
    spec = preset("tiny-mha", PS)
    dev, host_pool = DevicePool(spec, device), HostPool(spec, host)
    mover = open_storage(storage, host_pool, Fingerprint.of("parts", spec)) if storage else None
    config = CacheConfig(**cfg)
    return compose_tiers(classic_tiers(dev, host_pool, config, storage=mover), config)


def device_node(p, tokens: list[int]):
    """A DEVICE leaf under the root holding fresh device slots, placed in its tiers."""
    slots, _ = p.device.alloc(len(tokens))
    n = p.tree.add_child(p.tree.root, np.array(tokens), slots)
    p.moves.place(n)
    return n


def test_device_tier_holds_requests_slots_and_refuses_a_free_of_others() -> None:
    d = DeviceTier(DevicePool(preset("tiny-mha", PS), 8), LRU())
    slots, runs = d.alloc(4)
    assert runs == [(0, 4)] and d.available() == 4
    d.hold(slots.numpy())
    assert d.held_slots().tolist() == [0, 1, 2, 3]
    with pytest.raises(SlotError, match="not held"):
        d.free_held(torch.tensor([2, 3, 4, 5]))
    assert d.available() == 4 and d.held_slots().tolist() == [0, 1, 2, 3]  # nothing changed
    d.free_held(slots[:2])
    assert d.available() == 6 and d.held_slots().tolist() == [2, 3]
    assert d.alloc(8) is None


def test_tiers_queue_what_they_may_evict_and_offer_only_evictable_leaves() -> None:
    p = parts()
    a = device_node(p, [1, 1, 2, 2])
    b = p.tree.add_child(a, np.array([3, 3]), p.device.alloc(2)[0])
    p.moves.place(b)
    assert p.device.holds(a) and not p.host.holds(a)
    assert list(p.device.candidates()) == [b]  # `a` has a child on the device
    b.lock = 1
    assert list(p.device.candidates()) == []
    b.lock = 0
    p.moves.backup(b)
    p.moves.settle()
    assert p.moves.evict_device(2) == 2 and b.state is NodeState.HOST
    assert p.host.holds(b) and p.host.evictable(b) and list(p.device.candidates()) == [a]
    b.lock = 1
    assert not p.host.evictable(b)


def test_in_flight_completes_in_order_and_stops_at_the_first_unfinished() -> None:
    class T:
        def __init__(self, done: bool) -> None:
            self.finished = done

        def done(self) -> bool:
            return self.finished

    first, second, third = T(True), T(False), T(True)
    f = InFlight()
    for t in (first, second, third):
        f.track(t, [], None, Direction.BACKUP)
    assert [t for t in f.done()] == [first]  # the caller did not complete it: still tracked
    f.pop(first)
    assert list(f.done()) == [] and len(f) == 2  # `third` waits behind `second`
    second.finished = True
    seen = []
    for t in f.done():
        seen.append(t)
        f.pop(t)
    assert seen == [second, third] and len(f) == 0


def test_one_rank_agrees_with_itself_and_a_short_device_says_so() -> None:
    spec = preset("tiny-mha", PS)
    a = RankAgreement(None, spec, None)
    assert not a.writes_storage and a.pages(3) == 3
    with pytest.raises(CacheFullError, match="4 device slots needed, 2 free"):
        a.device_alloc(None, 4, lambda s: None, 2)
    got = (torch.arange(4), [(0, 4)])
    assert a.device_alloc(got, 4, lambda s: None, 0) is got


def test_a_cut_keeps_whole_nodes_within_both_counts() -> None:
    p = parts()
    d1, d2 = device_node(p, [1, 1]), device_node(p, [2, 2])
    h1 = device_node(p, [3, 3, 3, 3])  # (`_cut` reads lengths only)
    assert _cut([d1, d2], [h1], 4, 8) == ([d1, d2], [h1])
    assert _cut([d1, d2], [h1], 4, 6) == ([d1, d2], [])
    assert _cut([d1, d2], [h1], 2, 8) == ([d1], [])  # the device part cut: no host part after it


def test_moves_back_up_on_a_signal_and_evict_keeping_the_host_copy() -> None:
    p = parts(write_policy="write_back")
    n = device_node(p, [5, 5, 6, 6])
    assert p.moves.backup(n) and n.state is NodeState.BACKING_UP
    p.moves.poll()
    assert n.state is NodeState.BACKING_UP  # the deferred lane has not run the copy
    assert p.moves.evict_device(4) == 4  # waits for this backup only, then frees the device slots
    assert n.state is NodeState.HOST and n.device_slots is None and p.device.available() == 16
    assert p.host.holds(n) and not p.device.holds(n)
    assert p.moves.evict_host(4) == 4 and n.state is NodeState.DROPPED and p.host.available() == 16


def test_a_device_node_without_a_host_copy_is_dropped_with_its_host_subtree() -> None:
    p = parts(write_policy="write_through_selective")  # no backup at eviction
    n = device_node(p, [7, 7])
    child = p.tree.add_child(n, np.array([8, 8]), p.device.alloc(2)[0])
    p.moves.place(child)
    p.moves.backup(child)
    p.moves.settle()
    assert p.moves.evict_device(2) == 2 and child.state is NodeState.HOST  # the leaf goes first
    assert p.moves.evict_device(2) == 2
    assert n.state is NodeState.DROPPED and child.state is NodeState.DROPPED and p.tree.nodes() == []
    assert p.metrics.dropped_tokens == 4 and p.host.available() == 16 and p.device.available() == 16
    assert len(p.host.queue) == len(p.device.queue) == 0


def test_insert_checks_refuse_slots_the_caller_does_not_hold() -> None:
    p = parts()
    n = device_node(p, [1, 1])
    held, _ = p.device.alloc(2)
    p.device.hold(held.numpy())
    key = np.array([1, 1, 2, 2])
    s = check_insert(p.tree, p.device, key, torch.cat([n.device_slots, held]))
    assert s.tolist() == [*n.device_slots.tolist(), *held.tolist()]
    with pytest.raises(SlotError, match="not held by the caller"):
        check_insert(p.tree, p.device, key, torch.tensor([9, 10, *held.tolist()]))
    with pytest.raises(SlotError, match="whole number of pages"):
        check_insert(p.tree, p.device, key[:3], held[:1].repeat(3))


def test_storage_tier_hashes_a_path_as_the_keys_chain_it_and_caps_pending_writes(tmp_path) -> None:
    cfg = StorageConfig(f"file://{tmp_path}", max_pending_write_tokens=4, writers=1)
    p = parts(storage=cfg)
    st = p.storage
    a = device_node(p, [1, 1, 2, 2])
    b = p.tree.add_child(a, np.array([3, 3]), p.device.alloc(2)[0])
    keys = st.mover.keys
    assert st.hashes(b) == keys.chain(keys.root, np.array([1, 1, 2, 2, 3, 3]))[2:]
    assert a.page_hashes == keys.chain(keys.root, np.array([1, 1, 2, 2]))  # kept on the way
    assert not st.store(a)  # not on the host: nothing to write
    for n in (a, b):
        p.moves.backup(n)
    p.moves.settle()  # completes both backups; write-through starts the first write only
    assert a.state in (NodeState.BOTH_STORING, NodeState.BOTH_STORED)  # (the writer may be done)
    assert b.state is NodeState.BOTH
    assert st.metrics.writes_dropped == 1
    p.moves.finish_stores()
    assert a.state is NodeState.BOTH_STORED and st.pending_write_tokens == 0
    assert st.mover.submit(LookupPages(a.page_hashes)).pages == 2
    st.close()
