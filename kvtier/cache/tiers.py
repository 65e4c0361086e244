"""Each slot tier's accounting and eviction order: `DeviceTier`, `HostTier`.

A tier answers what it holds (`holds(node)`, read from the node's state), hands out and
takes back slots (`alloc` / `free`), and ranks what it would evict first (`candidates`:
its `EvictionQueue` in policy order, filtered by its own leaf rule). It never moves a
byte and never changes a node's state: the manager's moves (`kvtier.cache.moves`) do, and
then `place` the node, so each queue holds exactly the nodes its tier may evict:

- device queue: every node with device slots; a candidate is an unlocked node none of
  whose children is on the device (device residency is closed under prefixes);
- host queue: every host-only node; a candidate is an unlocked childless one no storage
  write reads.

`DeviceTier` also knows which of its slots requests hold (`hold` / `unhold`): slots
handed out by `alloc_device` and not yet inserted or freed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np
import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.cache.policy import EvictionPolicy, EvictionQueue
from kvtier.cache.radix import Node
from kvtier.cache.states import NodeState
from kvtier.errors import SlotError
from kvtier.slots import as_slots, fmt_ids

Runs = list[tuple[int, int]]


class SlotTier(ABC):
    """A tier of `num_slots` slots in pages of `page_size`: an allocator and an eviction queue."""

    name: str

    def __init__(
        self, num_slots: int, page_size: int, alloc_policy: AllocPolicy, policy: EvictionPolicy
    ) -> None:
        self.num_slots = num_slots
        self.allocator = HostSlotAllocator(num_slots, page_size, alloc_policy)
        self.queue = EvictionQueue(policy)

    @abstractmethod
    def holds(self, n: Node) -> bool:
        """Whether `n` has slots here that this tier evicts (its queue's members)."""

    @abstractmethod
    def evictable(self, n: Node) -> bool:
        """Whether `n` may be evicted from this tier now."""

    def place(self, n: Node) -> None:
        """Put `n` in this tier's queue if it holds it now, else take it out."""
        if self.holds(n):
            self.queue.add(n)
        else:
            self.queue.discard(n)

    def alloc(self, n: int) -> tuple[torch.Tensor, Runs] | None:
        """`n` slots and their `(first, length)` runs, or None when fewer are free."""
        return self.allocator.alloc_runs(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available(self) -> int:
        return self.allocator.available()

    def candidates(self) -> Iterator[Node]:
        """Evictable nodes in policy order, while the caller evicts them."""
        return self.queue.candidates(self.evictable)

    def fragmentation(self) -> dict[str, int]:
        a = self.allocator
        return {
            f"{self.name}_free_slots": a.available(),
            f"{self.name}_free_runs": a.free_runs(),
            f"{self.name}_largest_free_run": a.largest_free_run(),
        }


class DeviceTier(SlotTier):
    """The device pool's slots: nodes' and those requests hold (see the module docstring)."""

    name = "device"

    def __init__(self, num_slots: int, page_size: int, policy: EvictionPolicy) -> None:
        super().__init__(num_slots, page_size, AllocPolicy.CONTIGUOUS, policy)
        self._held = np.zeros(num_slots, dtype=bool)

    def holds(self, n: Node) -> bool:
        return n.state.on_device

    def evictable(self, n: Node) -> bool:
        return (
            n.state.on_device
            and not n.state.loading
            and n.lock == 0
            and not any(c.state.on_device for c in n.children.values())
        )

    def hold(self, slots: np.ndarray) -> None:
        self._held[slots] = True

    def unhold(self, slots: np.ndarray) -> None:
        self._held[slots] = False

    def all_held(self, slots: np.ndarray) -> bool:
        return bool(self._held[slots].all())

    def held_mask(self, slots: np.ndarray) -> np.ndarray:
        return self._held[slots]

    def held_slots(self) -> np.ndarray:
        """`[k]` int64: slots requests hold, ascending."""
        return np.flatnonzero(self._held)

    def free_held(self, slots: torch.Tensor) -> None:
        """Take back slots a request holds; SlotError (nothing changed) for any it does not."""
        s = as_slots("slots", slots, self.num_slots)
        not_held = s[~self._held[s]]
        if len(not_held):
            raise SlotError(f"free_device: slots {fmt_ids(not_held)} are not held by a request")
        self.allocator.free(s)
        self._held[s] = False


class HostTier(SlotTier):
    """The host pool's slots (see the module docstring)."""

    name = "host"

    def holds(self, n: Node) -> bool:
        return n.state.host_only

    def evictable(self, n: Node) -> bool:
        return n.state in (NodeState.HOST, NodeState.HOST_STORED) and n.lock == 0 and not n.children
