"""How the caches of tensor-parallel ranks take every decision together (`RankAgreement`).

Each rank runs its own `CacheController` over its own pools, is fed the same calls in the
same order, and must answer every call alike: a rank that reloaded a prefix another rank
recomputes would run a different model step. What a call returns is agreed over the
`RankGroup` (`agree_min`, a collective, at the same points on every rank):

- `match`: the device tokens, the tree's tokens and the storage pages. The local match is
  cut to whole nodes at or below the agreed counts (a rank whose device part is cut keeps
  none of its host part: the next node is on its device, not to be loaded), its storage
  lookup redone from the cut, and the counts agreed again until every rank holds the same
  (one round when they already do; each further round lowers some rank's counts, so it
  ends). Nodes past the cut are simply not part of the match: the tree is unchanged, a
  node split for a partial page stays valid, and the touch, the hits and the selective
  backups count only the agreed nodes.
- Device allocations (`alloc_device`, `load_back`): they succeed on every rank or raise
  `CacheFullError` on every rank (the ranks that got slots give them back).
- A prefetch: `acquire` fetches the pages every rank has host slots for (or none);
  `load_back` keeps the pages that arrived on every rank.

What stays local is what a rank holds, never what a call answers: host evictions (host
pools may differ in size), backups skipped for want of host room, storage writes and
their completion, the pages a prefetch keeps when a `release` or `insert` ends it. Those
only change what a later local walk finds, and every later match is agreed again. The
device part cannot drift apart in what a call answers either: device slots free plus
unlocked are the pool less the locked and held slots, which the agreed calls make equal
on every rank; the agreement of allocations makes that a checked rule, not an assumption.
Slot ids differ per rank (each its own pool): a caller uses each rank's own.

Storage writes: where `kvtier.storage.keys.is_ranked(spec)` is false (MLA latent, DSA
indexer: the bytes are the same on every rank, the key leaves the rank out) only
`ranks.is_writer` writes pages; every rank reads them. Otherwise each rank writes its own
pages under its own key (`RankGroup.fingerprint`). `RankAgreement` checks both when built:
ranked keys differ on every rank, unranked ones are equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kvtier.cache.radix import Node
from kvtier.cache.ranks import RankGroup
from kvtier.cache.storage_mover import HostStorageMover
from kvtier.errors import CacheFullError, ConfigError
from kvtier.spec import KVSpec
from kvtier.storage.keys import is_ranked

INT64_MAX = 2**63 - 1


class Lookup(Protocol):
    def lookup(self, key: np.ndarray, matched: int, last: Node) -> tuple[list[bytes], np.ndarray]:
        """The hashes and tokens of the leading pages of `key[matched:]` that storage holds."""


class RankAgreement:
    """The agreed decisions of one rank's cache (see the module docstring).

    `ranks`: the group (None: one process); `storage`: the rank's storage mover, or None.
    Building it is a collective over the group (the checks of the module docstring).
    """

    def __init__(self, ranks: RankGroup | None, spec: KVSpec, storage: HostStorageMover | None) -> None:
        self.ranks = ranks = ranks or RankGroup.single()
        self.spec = spec
        self.writes_storage = storage is not None and (ranks.is_writer or is_ranked(spec))
        if ranks.world == 1:
            return
        ranks.agree_same(spec.page_size)
        ranks.agree_same(spec.bytes_per_token())
        ranks.agree_same(int(storage is not None))
        if storage is None:
            return
        mine = int.from_bytes(storage.keys.fingerprint.digest[:8], "little", signed=True)
        every = ranks.agree_min([mine if r == ranks.rank else INT64_MAX for r in range(ranks.world)])
        distinct = len(set(every))
        if is_ranked(spec) and distinct != ranks.world:
            raise ConfigError(
                f"rank {ranks.rank}: K/V differs by rank but {ranks.world} ranks have {distinct} storage "
                "keys: build each rank's fingerprint with its rank (RankGroup.fingerprint)"
            )
        if not is_ranked(spec) and distinct != 1:
            raise ConfigError(
                f"rank {ranks.rank}: every rank holds the same bytes ({spec.name}) but the ranks "
                f"have {distinct} storage keys: build them from one model, config and spec"
            )

    def match(
        self,
        key: np.ndarray,
        device_nodes: list[Node],
        host_nodes: list[Node],
        root: Node,
        storage: Lookup | None,
    ) -> tuple[list[Node], list[Node], list[bytes], np.ndarray]:
        """The match every rank holds: its device and host nodes, the storage pages' hashes and tokens."""
        ps = self.spec.page_size
        while True:
            d = sum(len(n) for n in device_nodes)
            t = d + sum(len(n) for n in host_nodes)
            path = device_nodes + host_nodes
            last = path[-1] if path else root
            hashes, found = storage.lookup(key, t, last) if storage is not None else ([], key[:0])
            if self.ranks.world == 1:
                return device_nodes, host_nodes, hashes, found
            low_d, low_t, low_s, neg_high_d, neg_high_t = self.ranks.agree_min([d, t, len(hashes), -d, -t])
            if low_d == -neg_high_d and low_t == -neg_high_t:
                return device_nodes, host_nodes, hashes[:low_s], found[: low_s * ps]
            device_nodes, host_nodes = _cut(device_nodes, host_nodes, low_d, low_t)

    def device_alloc(
        self,
        got: tuple[torch.Tensor, list[tuple[int, int]]] | None,
        n: int,
        free: Callable[[torch.Tensor], None],
        available: int,
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """`got` (an allocation of `n` device slots, None: short) where every rank got one, else
        `CacheFullError` on every rank (the slots given back through `free`); `available`: the
        slots free here, for the message."""
        everyone = self.ranks.world == 1 or self.ranks.agree_min([int(got is not None)])[0] == 1
        if got is not None and everyone:
            return got
        if got is not None:
            free(got[0])
            raise CacheFullError(
                f"{n} device slots needed: rank {self.ranks.rank} has them, another rank not"
            )
        raise CacheFullError(
            f"{n} device slots needed, {available} free after evicting every "
            f"unlocked node (rank {self.ranks.rank} of {self.ranks.world})"
        )

    def pages(self, pages: int) -> int:
        """The least of every rank's `pages` (a prefetch's)."""
        return pages if self.ranks.world == 1 else self.ranks.agree_min([pages])[0]


def _cut(
    device_nodes: list[Node], host_nodes: list[Node], device: int, total: int
) -> tuple[list[Node], list[Node]]:
    """The longest whole-node prefix of the match within `device` device tokens and `total` tokens."""
    dev: list[Node] = []
    at = 0
    for n in device_nodes:
        if at + len(n) > device:
            return dev, []  # the next node is on this rank's device: none of the host part follows it
        dev.append(n)
        at += len(n)
    host: list[Node] = []
    for n in host_nodes:
        if at + len(n) > total:
            break
        host.append(n)
        at += len(n)
    return dev, host
