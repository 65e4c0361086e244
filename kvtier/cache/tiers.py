"""The tiers a cache is built from, and the interface each implements (`Tier`).

A cache is a list of tiers, top first: a device tier (`DeviceTier`, kvtier's own slots, or
`ExternalDeviceTier`, another engine's blocks), a `HostTier`, and optionally a storage
tier (`kvtier.cache.storage_tier.StorageTier`). Each tier answers four questions and
moves nothing itself:

- `holds(node)`: whether the node's state says this tier holds its pages (for a tier with
  an eviction queue: whether the node is in it);
- `alloc(n)` / `free(grant)`: room for `n` tokens, and its return (slots for the device
  and host tiers; the storage tier's room is its write budget);
- `candidates()`: what it would evict first (its `EvictionQueue` in policy order,
  filtered by `evictable`, its own leaf rule; the storage tier evicts nothing itself);
- `owner`: `Owner.KVTIER` (kvtier allocates and evicts) or `Owner.ENGINE` (another engine
  does and tells the cache: `CacheController.device_freed`).

Every tier below the top carries `mover`, a `kvtier.cache.movers.Mover` between it and the
tier above (`DeviceHostMover` for the host, `HostStorageMover` for storage). The manager's moves
(`kvtier.cache.moves`) change nodes' states, then `place` them, so each queue holds exactly
what its tier may evict:

- device queue: every node with device slots; a candidate is an unlocked node none of
  whose children is on the device (device residency is closed under prefixes);
- host queue: every host-only node; a candidate is an unlocked childless one no storage
  write reads.

`DeviceTier` also knows which of its slots requests hold (`hold` / `unhold`): slots
handed out by `alloc_device` and not yet inserted or freed. `ExternalDeviceTier` holds no
allocator: its slots are the engine's blocks (`slots(block_ids)`), which kvtier only reads
(backups) and writes (loads into blocks the engine allocated). It indexes its slots by the
node on them (kept by `place`, which the moves call whenever a node's device slots change,
a split's both halves included), so `nodes_on(slots)`, what `device_freed` asks, costs
O(k log k) for k freed slots, never a pass over the nodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from enum import Enum

import numpy as np
import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.cache.movers import Mover
from kvtier.cache.policy import EvictionPolicy, EvictionQueue
from kvtier.cache.radix import Node
from kvtier.cache.states import NodeState
from kvtier.errors import CacheStateError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.slots import as_slots, fmt_ids

Runs = list[tuple[int, int]]


class Owner(str, Enum):
    """Who allocates a tier's room and decides its evictions."""

    KVTIER = "kvtier"
    ENGINE = "engine"  # another engine; kvtier is told what exists and what was freed


class Tier(ABC):
    """One level of the hierarchy (see the module docstring)."""

    name: str
    owner: Owner = Owner.KVTIER
    #: Moves bytes between this tier and the one above (None for the top tier).
    mover: Mover | None = None

    @abstractmethod
    def holds(self, n: Node) -> bool:
        """Whether `n`'s state says this tier holds its pages."""

    @abstractmethod
    def alloc(self, n: int) -> object | None:
        """Room for `n` tokens, or None where there is none."""

    @abstractmethod
    def free(self, grant: object) -> None:
        """Give back what `alloc` gave."""

    @abstractmethod
    def candidates(self) -> Iterator[Node]:
        """What this tier would evict first, in order, while the caller evicts it."""


class SlotTier(Tier):
    """A tier of `pool.num_slots` slots in whole pages: an allocator and an eviction queue by `policy`."""

    def __init__(
        self, pool: DevicePool | HostPool, policy: EvictionPolicy, alloc_policy: AllocPolicy
    ) -> None:
        self.pool = pool
        self.num_slots, self.page_size = pool.num_slots, pool.spec.page_size
        self.allocator = HostSlotAllocator(self.num_slots, self.page_size, alloc_policy)
        self.queue = EvictionQueue(policy)

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
        """`[n]` int64 slots and their `(first, length)` runs, or None when fewer are free."""
        return self.allocator.alloc_runs(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def available(self) -> int:
        return self.allocator.available()

    def candidates(self) -> Iterator[Node]:
        return self.queue.candidates(self.evictable)

    def fragmentation(self) -> dict[str, int]:
        a = self.allocator
        return {
            f"{self.name}_free_slots": a.available(),
            f"{self.name}_free_runs": a.free_runs(),
            f"{self.name}_largest_free_run": a.largest_free_run(),
        }


class DeviceTier(SlotTier):
    """kvtier's own device slots over `pool`: nodes' and those requests hold (see the module docstring)."""

    name = "device"

    def __init__(self, pool: DevicePool, policy: EvictionPolicy) -> None:
        super().__init__(pool, policy, AllocPolicy.CONTIGUOUS)
        self._held = np.zeros(self.num_slots, dtype=bool)

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


class ExternalDeviceTier(DeviceTier):
    """Another engine's device blocks (`pool`: `DevicePool.wrap` over its KV tensors, each viewed as
    `[num_blocks * block_size, *row]`, so block b is slots `b * block_size ...`; the page size is the
    block size). kvtier allocates nothing here and evicts nothing: the engine says which blocks
    hold which pages (`insert`) and which it freed (`CacheController.device_freed`)."""

    name = "device"
    owner = Owner.ENGINE

    def __init__(self, pool: DevicePool, policy: EvictionPolicy) -> None:
        super().__init__(pool, policy)
        self.allocator = None  # type: ignore[assignment]
        self.num_blocks = self.num_slots // self.page_size
        # Per slot: the id of the node placed on it (0: none) and the slot's position in that node.
        # An entry outlives its node's leaving the slot; `nodes_on` checks it against the node.
        self._node_id = np.zeros(self.num_slots, dtype=np.int64)
        self._at = np.zeros(self.num_slots, dtype=np.int64)
        self._on_device: dict[int, Node] = {}  # by id: the nodes this tier holds

    def place(self, n: Node) -> None:
        """Queue `n` as every tier does, and index its slots (or forget it, where it left)."""
        super().place(n)
        if self.holds(n):
            s = n.device_slots.numpy()
            self._node_id[s] = n.id
            self._at[s] = np.arange(len(s))
            self._on_device[n.id] = n
        else:
            self._on_device.pop(n.id, None)

    def nodes_on(self, slots: np.ndarray) -> list[tuple[Node, int]]:
        """The nodes on `slots` (`[k]` int64), each once with the first of its pages among them."""
        if not len(slots):
            return []
        ids, at = self._node_id[slots], self._at[slots]
        order = np.lexsort((at, ids))  # by node, then by position in it
        ids, at, slots = ids[order], at[order], slots[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]).tolist()
        out = []
        for lo, hi in zip(starts, [*starts[1:], len(ids)], strict=True):
            n = self._on_device.get(int(ids[lo]))
            if n is None:
                continue  # no node, or one no longer on the device
            mine = n.device_slots.numpy()
            pos = at[lo:hi]
            inside = pos < len(mine)
            now = np.zeros(len(pos), dtype=bool)
            now[inside] = mine[pos[inside]] == slots[lo:hi][inside]  # (else the node has left the slot)
            if now.any():
                out.append((n, int(pos[now][0]) // self.page_size))
        return out

    def slots(self, block_ids: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
        """`[len(block_ids) * block_size]` int64 slots of the blocks, in order; SlotError for a bad id."""
        b = as_slots("block_ids", block_ids, self.num_blocks)
        s = (b[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
        return torch.from_numpy(s)

    def blocks(self, slots: torch.Tensor) -> np.ndarray:
        """`[k]` int64: the blocks of whole-page `slots`, in order."""
        return slots.numpy()[:: self.page_size] // self.page_size

    def alloc(self, n: int) -> None:
        raise CacheStateError(f"{n} device slots asked of a device tier the engine owns: it allocates them")

    def free(self, slots: torch.Tensor) -> None:
        """Nothing: the engine's block stays the engine's (kvtier stops referring to it)."""

    def available(self) -> int:
        return 0

    def evictable(self, n: Node) -> bool:
        return False  # the engine evicts: `device_freed`

    def held_mask(self, slots: np.ndarray) -> np.ndarray:
        return np.ones(len(slots), dtype=bool)  # every block is the engine's to give

    def free_held(self, slots: torch.Tensor) -> None:
        raise CacheStateError("free_device on a device tier the engine owns: tell the cache device_freed")

    def fragmentation(self) -> dict[str, int]:
        return {}


class HostTier(SlotTier):
    """The host pool's slots (see the module docstring); `mover`: device <-> host (None: the
    cache makes a `DeviceHostMover` from its config)."""

    name = "host"

    def __init__(
        self,
        pool: HostPool,
        policy: EvictionPolicy,
        alloc_policy: AllocPolicy = AllocPolicy.CONTIGUOUS,
        mover: Mover | None = None,
    ) -> None:
        super().__init__(pool, policy, alloc_policy)
        self.mover = mover

    def holds(self, n: Node) -> bool:
        return n.state.host_only

    def evictable(self, n: Node) -> bool:
        return n.state in (NodeState.HOST, NodeState.HOST_STORED) and n.lock == 0 and not n.children
