"""Eviction policies: the order each evicts in, ties between a parent and its child, and the cost."""

from __future__ import annotations

import pytest
import torch

from kvtier.cache import CacheConfig, CacheController, NodeState, WritePolicy
from kvtier.cache.policy import LRU, EvictionQueue
from kvtier.cache.radix import Node
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset


def make(eviction: str, device: int = 64, host: int = 128) -> CacheController:
    spec = preset("tiny-mha", 1)
    return CacheController(
        DevicePool(spec, device),
        HostPool(spec, host),
        CacheConfig(write_policy=WritePolicy.WRITE_BACK, eviction=eviction),
    )


def put(c: CacheController, tokens: tuple[int, ...]) -> None:
    m = c.match(tokens)
    lease = c.acquire(m)
    slots = torch.cat([m.device_slots, c.alloc_device(len(tokens) - m.device_tokens)])
    c.insert(tokens, slots)
    c.release(lease)


def on_device(c: CacheController, tokens: tuple[int, ...]) -> bool:
    return c.match(tokens).device_tokens == len(tokens)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_the_policy_picks_which_prefix_leaves_the_device(eviction: str) -> None:
    """A prefix hit three times and one used once since: LRU drops the hit one, LFU the other."""
    c = make(eviction)
    hot, cold = (1, 2, 3, 4), (5, 6, 7, 8)
    put(c, hot)
    for _ in range(3):
        c.match(hot)
    put(c, cold)  # used last: the most recent
    c.evict_device(4)
    c.flush()
    survivor = cold if eviction == "lru" else hot
    gone = hot if eviction == "lru" else cold
    assert c.match(survivor).device_tokens == 4
    assert c.match(gone).device_tokens == 0 and c.match(gone).tokens == 4  # still on the host
    c.check_invariants()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_parent_tied_with_its_child_goes_right_after_it(eviction: str) -> None:
    """A split makes a parent with its child's rank: one eviction takes the child, then the parent."""
    c = make(eviction)
    put(c, (1, 2, 3, 4, 5, 6))
    c.match((1, 2, 3, 9))  # splits the node after 3 tokens: head and tail tie
    put(c, (7, 8, 9, 10, 11, 12))
    c.match((7, 8, 9, 10, 11, 12))  # more recent, and hit more: goes last either way
    freed = c.evict_device(6)
    c.flush()
    assert freed == 6
    assert c.match((1, 2, 3, 4, 5, 6)).device_tokens == 0
    assert on_device(c, (7, 8, 9, 10, 11, 12))
    c.check_invariants()


def test_locked_paths_are_passed_over_and_kept() -> None:
    c = make("lru")
    put(c, (1, 2, 3, 4))
    put(c, (5, 6, 7, 8))
    lease = c.acquire(c.match((1, 2, 3, 4)))
    c.match((5, 6, 7, 8))  # now the more recent: LRU would take (1, 2, 3, 4) first
    assert c.evict_device(4) == 4
    c.flush()
    assert on_device(c, (1, 2, 3, 4)) and not on_device(c, (5, 6, 7, 8))
    c.release(lease)
    c.check_invariants()


def test_a_deep_chain_evicts_leaf_first_in_one_call() -> None:
    """Every node of a chain evicted in one call: each parent becomes a leaf once its child goes."""
    c = make("lfu", device=64)
    tokens = tuple(range(40))
    for end in range(4, 41, 4):  # ten nodes, each the child of the one before
        put(c, tokens[:end])
    assert c.evict_device(40) == 40
    c.flush()
    assert all(n.state is NodeState.HOST for n in c.tree.nodes())
    c.check_invariants()


class _Chain:
    """A plain queue over a synthetic tree: `width` chains of `depth` nodes, touched like the cache does."""

    def __init__(self, width: int, depth: int) -> None:
        self.queue = EvictionQueue(LRU())
        root = Node(key=torch.empty(0).numpy(), parent=None)
        tick = 0
        for _ in range(width):
            parent, tick = root, tick + 1
            for _ in range(depth):
                n = Node(key=torch.zeros(1, dtype=torch.int64).numpy(), parent=parent, last_access=tick)
                parent.children[(n.id,)] = n
                self.queue.add(n)
                parent = n


def test_evicting_k_nodes_looks_at_about_k_nodes_not_the_tree() -> None:
    """The cost rule: taking 50 leaves of a 20,000-node queue checks about 50 + their parents."""
    tree = _Chain(width=2000, depth=10)
    checked = 0

    def eligible(n: Node) -> bool:
        nonlocal checked
        checked += 1
        return not n.children

    taken = []
    for n in tree.queue.candidates(eligible):
        taken.append(n)
        tree.queue.discard(n)
        del n.parent.children[next(k for k, v in n.parent.children.items() if v is n)]
        if len(taken) == 50:
            break
    assert len(taken) == 50
    assert checked <= 4 * 50, checked
    assert all(not n.children for n in taken)
