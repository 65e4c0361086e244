"""How the benchmarks fragment a slot pool: the one churn generator, and slot sets of fixed shape.

A `Churn` allocates sequences in a pool and frees them in fill/evict cycles, as a
serving cache does: each cycle fills the pool with sequences of 1 to `max_pages`
random pages until one does not fit, then evicts. What an eviction frees depends on
the target:

- `AllocatorChurn` (a `HostSlotAllocator` alone): the churn plays a radix cache and
  frees the tail pieces of random sequences (their leaves), a random number of pages
  at a time, until half the pool is free. It also runs `steady` churn: occupancy held
  at a share of the pool, each step freeing one random whole sequence or allocating one.
- `CacheChurn` (a `CacheController`): each sequence is inserted on the device, backed
  up and evicted to the host; after a fill, a random half of the cycle's sequences is
  matched (touched) and the cache's own policy evicts half of the host's used slots.
  Its tree stays consistent: every slot it holds belongs to a node.

Every random choice comes from one `random.Random(seed)` in a fixed order, so a seed
gives the same runs on every machine; the committed tables were measured with these
seeds and draws, so changing either changes their churn rows.

`runs_of` and `leave_free_runs` build fixed shapes instead of churn: runs of one
length at random places, and the free space left as exactly k runs.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.errors import InvariantError


class Churn(ABC):
    """Fill/evict cycles over one pool; a subclass says how a sequence is taken and what eviction frees."""

    def __init__(self, page_size: int, seed: int) -> None:
        self.page_size = page_size
        self.rng = random.Random(seed)

    def cycles(self, cycles: int, max_pages: int) -> None:
        """`cycles` times: take sequences of 1..`max_pages` random pages until one does not fit; evict."""
        for _ in range(cycles):
            while self.take(self.length(max_pages)):
                pass
            self.evict()

    def length(self, max_pages: int) -> int:
        """A random sequence length in slots: 1..`max_pages` whole pages."""
        return self.page_size * self.rng.randint(1, max_pages)

    @abstractmethod
    def take(self, n: int) -> bool:
        """Allocate one sequence of `n` slots; False (and no random draw) when it does not fit."""

    @abstractmethod
    def evict(self) -> None:
        """Free part of what the cycle filled."""


class AllocatorChurn(Churn):
    """Churn of a host allocator alone; `live` holds the slots of every sequence still allocated."""

    def __init__(self, alloc: HostSlotAllocator, seed: int = 0) -> None:
        super().__init__(alloc.page_size, seed)
        self.alloc = alloc
        self.live: list[torch.Tensor] = []

    def used(self) -> int:
        return self.alloc.num_slots - self.alloc.available()

    def take(self, n: int) -> bool:
        slots = self.alloc.alloc(n)
        if slots is None:
            return False
        self.live.append(slots)
        return True

    def evict(self) -> None:
        self.free_tails(self.alloc.num_slots // 2)

    def free_tails(self, free_target: int) -> None:
        """Free tails of random sequences, 1..all of their pages each, until `free_target` slots are free."""
        ps = self.page_size
        while self.alloc.available() < free_target and self.live:
            i = self.rng.randrange(len(self.live))
            self._free_tail(i, self.rng.randint(1, self.live[i].numel() // ps) * ps)

    def steady(self, ops: int, max_pages: int, fill: float) -> None:
        """Fill to `fill` of the pool, then `ops` steps: above it free a random sequence, else allocate."""
        target = fill * self.alloc.num_slots
        while self.used() < target and self.take(self.length(max_pages)):
            pass
        for _ in range(ops):
            # Occupancy stays within one allocation of the target.
            if self.live and self.used() >= target:
                i = self.rng.randrange(len(self.live))
                self._free_tail(i, self.live[i].numel())
            else:
                self.take(self.length(max_pages))

    def _free_tail(self, i: int, cut: int) -> None:
        seq = self.live[i]
        self.alloc.free(seq[-cut:])
        self.live[i] = seq[:-cut]
        if not self.live[i].numel():
            self.live[i] = self.live[-1]
            self.live.pop()


class CacheChurn(Churn):
    """Churn through a cache's own calls: insert, back up, evict to the host, match, evict the host."""

    def __init__(self, cache, seed: int = 0) -> None:
        super().__init__(cache.spec.page_size, seed)
        self.cache = cache
        self._taken: list[tuple[int, ...]] = []

    def cycles(self, cycles: int, max_pages: int) -> None:
        """As `Churn.cycles`; afterwards every sequence left is on the host only."""
        super().cycles(cycles, max_pages)
        self.cache.flush()
        self.cache.evict_device(10**9)

    def take(self, n: int) -> bool:
        cache = self.cache
        if cache.host_alloc.available() < n or cache.device_alloc.available() < n:
            return False
        tokens = tuple(self.rng.randrange(1 << 30) for _ in range(n))
        cache.insert(tokens, cache.alloc_device(n))
        self._taken.append(tokens)
        cache.flush()
        cache.evict_device(n)
        return True

    def evict(self) -> None:
        cache = self.cache
        for tokens in self.rng.sample(self._taken, len(self._taken) // 2):
            cache.match(tokens)
        cache.flush()
        cache.evict_host((cache.host_pool.num_slots - cache.host_alloc.available()) // 2)
        self._taken = []


def after_churn(
    policy: AllocPolicy | str, tokens: int, pool_slots: int, page_size: int, cycles: int, seed: int = 0
) -> torch.Tensor:
    """Slots `alloc(tokens)` returns after `cycles` allocator fill/evict cycles: `[tokens]` int64.

    Sequences are 1 to `tokens // 16` slots long (whole pages).
    """
    churn = AllocatorChurn(HostSlotAllocator(pool_slots, page_size, policy), seed)
    churn.cycles(cycles, max(1, tokens // 16 // page_size))
    churn.free_tails(tokens)
    slots = churn.alloc.alloc(tokens)
    if slots is None:
        raise InvariantError(f"{tokens} slots free after the churn, yet alloc({tokens}) failed")
    return slots


def runs_of(length: int, tokens: int, pool_slots: int, gen: torch.Generator) -> torch.Tensor:
    """`tokens` slot ids in runs of `length`, the runs at random places of a `pool_slots` pool: `[tokens]`."""
    count = -(-tokens // length)
    starts = torch.randperm(pool_slots // length, generator=gen)[:count] * length
    return (starts[:, None] + torch.arange(length)).flatten()[:tokens]


def leave_free_runs(alloc: HostSlotAllocator, piece: int, runs: int, gap: int) -> None:
    """Leave the allocator's free slots as `runs` runs of `piece` slots, `gap` slots held between each two.

    The gaps stay allocated for the allocator's life; nothing else is held.
    """
    pieces = []
    for i in range(runs):
        pieces.append(alloc.alloc(piece))
        if i < runs - 1:
            alloc.alloc(gap)
    for p in pieces:
        alloc.free(p)
