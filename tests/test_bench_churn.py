"""The one churn generator: the fragmentation each bench measured its committed tables after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.alloc import HostSlotAllocator
from kvtier.bench.churn import AllocatorChurn, CacheChurn, after_churn, leave_free_runs, runs_of
from kvtier.cache import CacheConfig, CacheController
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset


def runs(slots: torch.Tensor) -> int:
    s = np.asarray(slots)
    return int(1 + np.count_nonzero(np.diff(s) != 1))


@pytest.mark.parametrize(("policy", "want"), [("contiguous", 112), ("first_fit", 797)])
def test_the_transfer_benchs_churn_rows_keep_their_committed_run_counts(policy: str, want: int) -> None:
    """`kvtier bench transfer`'s churn rows: 131072 tokens after 8 cycles in a 262144-slot pool, seed 0.

    The H200 transfer tables measured so far list 112 and 797 host runs for them; a change to
    the generator's draws shows here first.
    """
    slots = after_churn(policy, 131072, 262144, 1, 8, seed=0)
    assert len(slots) == 131072 and len(torch.unique(slots)) == 131072
    assert runs(slots) == want


def test_churn_is_seeded() -> None:
    a = after_churn("first_fit", 4096, 8192, 4, 4, seed=1)
    assert torch.equal(a, after_churn("first_fit", 4096, 8192, 4, 4, seed=1))
    assert not torch.equal(a, after_churn("first_fit", 4096, 8192, 4, 4, seed=2))
    assert all(int(s) % 4 == 0 for s in a[::4])  # whole pages


@pytest.mark.parametrize(
    ("policy", "free_runs", "prefix_runs"), [("contiguous", 16, 2), ("first_fit", 107, 60)]
)
def test_steady_churn_holds_its_occupancy_and_keeps_its_runs(
    policy: str, free_runs: int, prefix_runs: int
) -> None:
    """The allocator bench's churn, small: at the committed size (4M slots, 60000 operations, seed 0)
    the same generator leaves 853 and 2911 free runs, as bench/results/cache_cpu_2026-11-29.json."""
    alloc = HostSlotAllocator(65536, 1, policy)
    churn = AllocatorChurn(alloc, seed=0)
    churn.steady(2000, 4096, 0.9)
    used = alloc.num_slots - alloc.available()
    assert used == sum(len(s) for s in churn.live)
    assert abs(used - 0.9 * 65536) < 4096  # within one allocation of the target
    assert alloc.free_runs() == free_runs
    got = alloc.alloc_runs(4096)
    assert got is not None and len(got[1]) == prefix_runs
    alloc.check_invariants()


def test_tail_eviction_frees_only_what_it_holds() -> None:
    alloc = HostSlotAllocator(8192, 4, "contiguous")
    churn = AllocatorChurn(alloc, seed=3)
    churn.cycles(3, 64)
    assert alloc.available() >= 4096
    held = torch.cat(churn.live)
    assert alloc.num_slots - alloc.available() == len(held) == len(torch.unique(held))
    assert bool(torch.from_numpy(alloc.allocated_mask())[held].all())
    alloc.check_invariants()


def test_cache_churn_leaves_a_consistent_cache_with_its_host_pool_fragmented() -> None:
    """The served bench's churn goes through the cache: every slot held belongs to a node, all on the host."""
    spec = preset("tiny-mla", 1)
    n = 128
    cache = CacheController(DevicePool(spec, n + 256, "cpu"), HostPool(spec, 4 * n + 1024), CacheConfig())
    CacheChurn(cache, seed=1000).cycles(2, max(2, n // 8))
    cache.check_invariants()
    assert cache.device_alloc.available() == cache.device_pool.num_slots  # evicted from the device
    assert cache.host_alloc.available() < cache.host_pool.num_slots
    # The served bench's seed: the committed table's host runs come from this draw order.
    assert cache.host_alloc.free_runs() == 41


@pytest.mark.parametrize(("page_size", "piece", "count"), [(1, 512, 8), (4, 256, 4), (1, 64, 1)])
def test_free_space_left_as_exactly_k_runs(page_size: int, piece: int, count: int) -> None:
    alloc = HostSlotAllocator(piece * count + (count - 1) * page_size, page_size)
    leave_free_runs(alloc, piece, count, page_size)
    assert alloc.available() == piece * count and alloc.free_runs() == count
    got = alloc.alloc_runs(piece * count)
    assert got is not None and len(got[1]) == count


def test_runs_of_a_length_at_random_places() -> None:
    slots = runs_of(16, 1000, 4096, torch.Generator().manual_seed(0))
    assert len(slots) == 1000 and len(torch.unique(slots)) == 1000
    starts = slots[::16]
    assert bool((starts % 16 == 0).all()) and runs(slots) <= 63
