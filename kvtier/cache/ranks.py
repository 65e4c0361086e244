"""The tensor-parallel ranks whose caches take every decision together (`RankGroup`).

With several GPUs of one host each rank runs its own process, its own device pool and its
own host pool, and every rank must load, evict and back up the same pages: a rank that
reloaded a page another rank recomputes would run a different model step. Each decision
that depends on a rank's own state is agreed over the group with an all-reduce of the
minimum (`agree_min`), so every rank ends with the numbers the most constrained rank can
meet. One process is the group of one (`RankGroup.single()`), whose calls cost nothing.

Storage: pages whose bytes are the same on every rank (MLA latent and DSA indexer rows,
`kvtier.storage.keys` leaves the rank out of their key) are written by `writer_rank` alone
and read by every rank; K/V split by heads is written by each rank under its own key
(`fingerprint` puts the rank in it).

Contract: every rank calls the same `RankGroup` methods in the same order (they are
collectives); a call on one rank alone blocks. The group's backend must reduce CPU int64
tensors (gloo) or the tensors are moved to `device` (nccl).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.spec import KVSpec
from kvtier.storage.keys import Fingerprint


@dataclass(frozen=True)
class RankGroup:
    """`rank` of `world` ranks over `group` (a `torch.distributed` process group, None: the default
    group; unused for one rank); `device`: where reduced tensors go (the CPU for gloo)."""

    rank: int = 0
    world: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    writer_rank: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} is outside a group of {self.world} ranks")
        if not 0 <= self.writer_rank < self.world:
            raise ConfigError(f"writer rank {self.writer_rank} is outside a group of {self.world} ranks")

    @classmethod
    def single(cls) -> RankGroup:
        return cls()

    @classmethod
    def from_distributed(cls, group: Any = None, device: torch.device | None = None) -> RankGroup:
        """This process's rank in `group` (default: the world) of an initialised `torch.distributed`."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised: call init_process_group first")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if device is None:
            device = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device("cuda")
        return cls(rank, world, group, device)

    def fingerprint(
        self, model: str, spec: KVSpec, config: Mapping[str, Any] | str | None = None
    ) -> Fingerprint:
        """This rank's storage fingerprint of `model` over `spec` (with the rank where K/V is split)."""
        return Fingerprint.of(model, spec, config, tp_rank=self.rank, tp_size=self.world)

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes the pages every rank holds alike."""
        return self.rank == self.writer_rank

    def agree_min(self, values: list[int]) -> list[int]:
        """Each of `values` replaced by its minimum over the ranks (one all-reduce for all of them)."""
        if self.world == 1 or not values:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.cpu().tolist()]

    def agree_same(self, value: int) -> int:
        """`value`, which every rank must hold alike; `ConfigError` on every rank where one differs."""
        if self.world == 1:
            return value
        low, neg_high = self.agree_min([value, -value])
        if low != -neg_high:
            raise ConfigError(f"ranks disagree: values from {low} to {-neg_high}, this rank {value}")
        return value
