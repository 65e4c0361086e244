"""Eviction policies: which unlocked leaf of a tier goes first.

A policy only ranks nodes (`EvictionPolicy.priority`: smaller goes first); it decides
nothing else. The manager keeps one `EvictionQueue` per tier, ordered by the policy,
and tells it when a node enters or leaves the tier or is touched.

Rule every policy keeps: a node's priority is never below its descendants' in the same
tier. The manager touches whole paths (a match or an insert updates every node from the
root down), so recency and hit counts only grow towards the root; a queue scanned from
its smallest entry then reaches a node's children before the node. Evicting k nodes
therefore costs O(k log n) plus the locked nodes passed over (which hold their whole
path: at most the leases' paths), never a pass over the tree.

Policies:
- `LRU`: least recently used first (the default);
- `LFU`: fewest hits first, least recently used among equals (keeps a shared system
  prompt hit by many requests over one-off prefixes touched more recently).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from kvtier.cache.radix import Node

Priority = tuple[int, ...]


class EvictionPolicy(ABC):
    """Ranks nodes for eviction; see the module docstring for the rule a priority keeps."""

    name: str

    @abstractmethod
    def priority(self, node: Node) -> Priority:
        """Smaller is evicted first."""


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, node: Node) -> Priority:
        return (node.last_access,)


class LFU(EvictionPolicy):
    name = "lfu"

    def priority(self, node: Node) -> Priority:
        return (node.hits, node.last_access)


class PolicyName(str, Enum):
    """The policies by name (configs, the CLI)."""

    LRU = "lru"
    LFU = "lfu"

    def make(self) -> EvictionPolicy:
        return LRU() if self is PolicyName.LRU else LFU()


class EvictionQueue:
    """One tier's nodes ordered by a policy (`(priority, node id)`), updated as they change.

    `add` / `discard` as a node enters or leaves the tier, `touch` after its priority
    changed; `candidates(eligible)` yields eligible nodes smallest first, while the
    caller evicts them.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._order: SortedList = SortedList()
        self._entry: dict[int, tuple[Priority, int]] = {}
        self._nodes: dict[int, Node] = {}

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, node: Node) -> bool:
        return node.id in self._entry

    def add(self, node: Node) -> None:
        if node.id in self._entry:
            return
        entry = (self.policy.priority(node), node.id)
        self._entry[node.id] = entry
        self._nodes[node.id] = node
        self._order.add(entry)

    def discard(self, node: Node) -> None:
        entry = self._entry.pop(node.id, None)
        if entry is not None:
            self._order.remove(entry)
            del self._nodes[node.id]

    def touch(self, node: Node) -> None:
        """Re-rank `node` (its recency or hits changed); nothing if it is not in this tier."""
        if node.id in self._entry:
            self.discard(node)
            self.add(node)

    def nodes(self) -> list[Node]:
        """Every node of the tier, smallest priority first (tests, invariants)."""
        return [self._nodes[i] for _, i in self._order]

    def candidates(self, eligible: Callable[[Node], bool]) -> Iterator[Node]:
        """Eligible nodes, smallest priority first, while the caller evicts them.

        The caller may remove the yielded node (and others) from the queue before asking
        for the next. A node passed over because it was not eligible yet (a parent whose
        last child in the tier is evicted after it, at an equal priority) is offered
        again once it is, so the order holds across ties.
        """
        last: tuple[Priority, int] | None = None
        again: list[tuple[Priority, int]] = []  # passed over, eligible since: behind `last`
        while True:
            at = self._order.bisect_right(last) if last is not None else 0
            ahead = self._order[at] if at < len(self._order) else None
            if again and (ahead is None or again[0] < ahead):
                entry = heapq.heappop(again)
            elif ahead is not None:
                entry = last = ahead
            else:
                return
            node = self._nodes.get(entry[1])
            if node is None or self._entry.get(node.id) != entry or not eligible(node):
                continue  # gone, re-ranked since it was queued, or not evictable now
            parent = node.parent
            yield node
            # The caller has evicted `node`: its parent may be a leaf now, behind the cursor.
            if parent is not None and last is not None:
                pe = self._entry.get(parent.id)
                if pe is not None and pe <= last and eligible(parent):
                    heapq.heappush(again, pe)
