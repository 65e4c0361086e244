"""Eviction at scale: what evicting k nodes costs on a tree of 100k nodes, per policy and tier.

A cache on the CPU (tiny rows: the bookkeeping is what is timed, not bytes) holds
`conversations` chains of `turns` nodes each, as multi-turn chats leave them; every
conversation is touched in a shuffled order, some several times, so the policies rank
nodes differently. Then `evict_device` (nodes dropped: no write-back) and, on a second
tree backed up to the host, `evict_host` free `k` nodes per call, `calls` times. The
baseline is what eviction did before the policy queues: a heap over every leaf of the
tree, built on each call (timed on the same tree without evicting).
"""

from __future__ import annotations

import heapq
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvtier.bench.common import environment
from kvtier.cache import CacheConfig, CacheController, NodeState, WritePolicy
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset

TOKENS_PER_NODE = 2


@dataclass(frozen=True)
class EvictRow:
    policy: str
    tier: str
    nodes: int
    k: int
    calls: int
    median_ms: float
    us_per_node: float
    baseline_ms: float


def run(
    nodes: int = 100_000, evict: int = 1000, policies=("lru", "lfu"), seed: int = 0, calls: int = 10
) -> tuple[list[EvictRow], dict]:
    """Rows per policy and tier (see the module docstring) and the run's metadata."""
    rows = []
    for policy in policies:
        for tier in ("device", "host"):
            with _tree(nodes, policy, tier, seed) as cache:
                baseline = _baseline_ms(cache, tier)
                times = _evict_calls(cache, tier, evict, calls)
                cache.check_invariants(compare_bytes=False)
            ms = statistics.median(times)
            rows.append(EvictRow(policy, tier, nodes, evict, calls, ms, ms * 1e3 / evict, baseline))
    meta = {**environment(torch.device("cpu")), "tokens_per_node": TOKENS_PER_NODE, "seed": seed}
    return rows, meta


def _tree(nodes: int, policy: str, tier: str, seed: int) -> CacheController:
    """A cache holding `nodes` nodes in chains of 10 (on the device, or backed up and on the host)."""
    turns = 10
    conversations = -(-nodes // turns)
    tokens = conversations * turns * TOKENS_PER_NODE
    spec = preset("tiny-mha", 1).with_layers(1)
    write = WritePolicy.WRITE_THROUGH if tier == "host" else WritePolicy.WRITE_THROUGH_SELECTIVE
    cache = CacheController(
        DevicePool(spec, tokens),
        HostPool(spec, tokens if tier == "host" else TOKENS_PER_NODE),
        CacheConfig(write_policy=write, selective_hits=10**9, eviction=policy),
    )
    rng = np.random.default_rng(seed)
    for conv in range(conversations):
        ids = np.arange(turns * TOKENS_PER_NODE, dtype=np.int64) + conv * 10**6
        for turn in range(1, turns + 1):
            prefix = ids[: turn * TOKENS_PER_NODE]
            m = cache.match(prefix)
            new = cache.alloc_device(len(prefix) - m.device_tokens)
            cache.insert(prefix, torch.cat([m.device_slots, new]))
    for conv in rng.integers(0, conversations, size=conversations * 2):  # later turns, some convs often
        cache.match(np.arange(rng.integers(1, turns + 1) * TOKENS_PER_NODE, dtype=np.int64) + conv * 10**6)
    if tier == "host":
        cache.flush()
        cache.evict_device(tokens)
    return cache


def _evict_calls(cache: CacheController, tier: str, k: int, calls: int) -> list[float]:
    evict = cache.evict_device if tier == "device" else cache.evict_host
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        evict(k * TOKENS_PER_NODE)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _baseline_ms(cache: CacheController, tier: str) -> float:
    """The former eviction's fixed cost per call: a heap over every leaf of the tree."""

    def leaf(n) -> bool:
        if tier == "host":
            return n.state is NodeState.HOST and n.lock == 0 and not n.children
        return n.state.on_device and n.lock == 0 and not any(c.state.on_device for c in n.children.values())

    t0 = time.perf_counter()
    heap = [(n.last_access, n.id, n) for n in cache.tree.nodes() if leaf(n)]
    heapq.heapify(heap)
    return (time.perf_counter() - t0) * 1e3


def rows_as_dicts(rows: list[EvictRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def render(rows: list[EvictRow], meta: dict):
    """The table `kvtier bench cache --parts eviction` prints."""
    from rich.table import Table

    table = Table(title=f"eviction of k nodes per call ({meta.get('cpu', meta.get('device'))})")
    for col in ("policy", "tier", "nodes", "k", "ms per call", "us per node", "full-tree heap ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.policy,
            r.tier,
            str(r.nodes),
            str(r.k),
            f"{r.median_ms:.2f}",
            f"{r.us_per_node:.1f}",
            f"{r.baseline_ms:.1f}",
        )
    return table
