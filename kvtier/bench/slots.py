"""Slot sets for benchmarks: from one run to fully scattered, and after allocator churn."""

from __future__ import annotations

import random

import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator


def runs_of(length: int, tokens: int, pool_slots: int, gen: torch.Generator) -> torch.Tensor:
    """`tokens` slot ids in runs of `length`, the runs at random places of a `pool_slots` pool: `[tokens]`."""
    count = -(-tokens // length)
    starts = torch.randperm(pool_slots // length, generator=gen)[:count] * length
    return (starts[:, None] + torch.arange(length)).flatten()[:tokens]


def after_churn(
    policy: AllocPolicy | str,
    tokens: int,
    pool_slots: int,
    page_size: int,
    cycles: int,
    seed: int = 0,
) -> torch.Tensor:
    """Slots `alloc(tokens)` returns after `cycles` fill/evict cycles: `[tokens]`.

    Each cycle fills the pool with sequences of 1 to `tokens // 16` slots (whole pages),
    then evicts like a radix cache: it frees the tail pieces of random sequences (their
    leaves), a random number of pages at a time, until half the pool is free.
    """
    rng = random.Random(seed)
    alloc = HostSlotAllocator(pool_slots, page_size, policy)
    largest = max(1, tokens // 16 // page_size)
    live: list[torch.Tensor] = []

    def evict_until(free_target: int) -> None:
        while alloc.available() < free_target and live:
            i = rng.randrange(len(live))
            pages = live[i].numel() // page_size
            cut = rng.randint(1, pages) * page_size
            alloc.free(live[i][-cut:])
            live[i] = live[i][:-cut]
            if not live[i].numel():
                live[i] = live[-1]
                live.pop()

    for _ in range(cycles):
        while (slots := alloc.alloc(rng.randint(1, largest) * page_size)) is not None:
            live.append(slots)
        evict_until(pool_slots // 2)
    evict_until(tokens)
    slots = alloc.alloc(tokens)
    assert slots is not None
    return slots
