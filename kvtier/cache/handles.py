"""What the cache hands its callers: a `Match`, a `Lease`, a `LoadHandle`; and its `CacheConfig`.

These are values and handles only; the manager (`CacheController`) changes state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvtier.alloc import AllocPolicy
from kvtier.cache.movers import Transfer
from kvtier.cache.policy import PolicyName
from kvtier.cache.radix import Node
from kvtier.cache.storage_io import Fetch
from kvtier.errors import ConfigError
from kvtier.transfer import KernelOptions, PathCosts, TransferPath, TransferPlan
from kvtier.transfer.lanes import Signal


class WritePolicy(str, Enum):
    """When device nodes are copied to the host."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclass(frozen=True)
class CacheConfig:
    """Policies of a `CacheController`.

    `write_policy`: when a device node is backed up (at insert, after `selective_hits`
    hits, or when evicted from the device). `eviction`: the policy ranking each tier's
    leaves (`lru` or `lfu`). `recompute_below`: host hits shorter than this many tokens
    are not loaded back; the handle says to recompute them. `costs`: the planner's costs (None:
    measured on a CUDA device at start, `kvtier.transfer.probe`). `force_path`: one transfer
    path for every load and backup instead of the planner's (benchmarks use `reference`
    for a stock-style configuration).
    """

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_hits: int = 2
    eviction: PolicyName = PolicyName.LRU
    recompute_below: int = 0
    host_alloc_policy: AllocPolicy = AllocPolicy.CONTIGUOUS
    costs: PathCosts | None = None
    kernel: KernelOptions = field(default_factory=KernelOptions)
    force_path: TransferPath | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
            object.__setattr__(self, "eviction", PolicyName(self.eviction))
            object.__setattr__(self, "host_alloc_policy", AllocPolicy(self.host_alloc_policy))
            if self.force_path is not None:
                object.__setattr__(self, "force_path", TransferPath(self.force_path))
        except ValueError as e:
            raise ConfigError(f"cache config: {e}") from None
        if self.selective_hits < 1 or self.recompute_below < 0:
            raise ConfigError(
                f"cache config: selective_hits ({self.selective_hits}) must be at least 1, "
                f"recompute_below ({self.recompute_below}) at least 0"
            )


@dataclass
class Match:
    """The longest cached prefix of some tokens.

    `device_slots`: `[device_tokens]` int64 CPU, the resident part, readable now.
    `host_nodes`: the nodes after it that are only on the host (`load_back` them).
    `storage_hashes` / `storage_key`: the leading pages after those that storage holds
    (their hashes; their tokens, `[storage_tokens]`), prefetched from `acquire` on
    (`prefetch`); `load_back` adds what arrived to `host_nodes` and `tokens`.
    """

    tokens: int
    device_tokens: int
    device_slots: torch.Tensor
    device_nodes: list[Node]
    host_nodes: list[Node]
    last_node: Node
    storage_hashes: list[bytes] = field(default_factory=list)
    storage_key: np.ndarray | None = None
    prefetch: Fetch | None = None
    storage_tokens_used: int = 0

    @property
    def host_tokens(self) -> int:
        return self.tokens - self.device_tokens - self.storage_tokens_used

    @property
    def storage_tokens(self) -> int:
        """Tokens storage holds after the tree's part (all may not arrive: see `storage_tokens_used`)."""
        return 0 if self.storage_key is None else len(self.storage_key)


@dataclass(eq=False)
class Lease:
    """A request's lock on a path of the tree (from the root to `node`)."""

    id: int
    node: Node
    released: bool = False


@dataclass(eq=False)
class LoadHandle:
    """A load back in flight.

    `device_slots`: `[tokens]` int64 CPU, where the loaded tokens land (valid for layer
    i after `wait_layer(i)`). `recompute`: nothing was loaded; the caller recomputes
    these tokens instead. `submit_s`: host seconds the submission took.
    """

    nodes: list[Node]
    tokens: int
    device_slots: torch.Tensor
    transfer: Transfer | None = None
    recompute: bool = False
    submitted_at: float = 0.0
    submit_s: float = 0.0
    done: bool = False

    @property
    def layer_signals(self) -> list[Signal]:
        return list(self.transfer.signals) if self.transfer is not None else []

    @property
    def plan(self) -> TransferPlan | None:
        """The load's transfer plan (built when first read where the load went out without one)."""
        return self.transfer.plan if self.transfer is not None else None

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer `layer` is loaded (no host wait on CUDA)."""
        if self.transfer is not None and self.transfer.signals:
            self.transfer.signals[layer].make_current_wait()

    def wait(self) -> None:
        """Block the host until every layer is loaded."""
        if self.transfer is not None:
            self.transfer.wait()
