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
    """Slots `alloc(tokens)` returns after `cycles` fill/evict cycles of random requests: `[tokens]`.

    Each cycle fills the pool with requests of 1 to `tokens // 16` slots (whole pages),
    then frees a random half of the live requests, like a cache evicting old prefixes.
    """
    rng = random.Random(seed)
    alloc = HostSlotAllocator(pool_slots, page_size, policy)
    largest = max(1, tokens // 16 // page_size)
    live: list[torch.Tensor] = []
    for _ in range(cycles):
        while (slots := alloc.alloc(rng.randint(1, largest) * page_size)) is not None:
            live.append(slots)
        rng.shuffle(live)
        half = len(live) // 2
        for slots in live[:half]:
            alloc.free(slots)
        live = live[half:]
    while alloc.available() < tokens:
        alloc.free(live.pop(rng.randrange(len(live))))
    slots = alloc.alloc(tokens)
    assert slots is not None
    return slots
