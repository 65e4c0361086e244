"""Moving KV rows between a `HostPool` and a `DevicePool`: plans (decide once) and copies (run per layer)."""

from kvtier.transfer.copy import backup, load_layer, load_layers
from kvtier.transfer.plan import (
    KernelOptions,
    Mechanism,
    PathCosts,
    Piece,
    Planner,
    TransferPath,
    TransferPlan,
)

__all__ = [
    "KernelOptions",
    "Mechanism",
    "PathCosts",
    "Piece",
    "Planner",
    "TransferPath",
    "TransferPlan",
    "backup",
    "load_layer",
    "load_layers",
]
