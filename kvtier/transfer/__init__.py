"""Moving KV rows between a `HostPool` and a `DevicePool`: plans (decided once) and their execution."""

from kvtier.transfer.execute import backup, load_layer, load_layers
from kvtier.transfer.options import KernelOptions, PathCosts
from kvtier.transfer.plan import Planner, TransferPath, TransferPlan

__all__ = [
    "KernelOptions",
    "PathCosts",
    "Planner",
    "TransferPath",
    "TransferPlan",
    "backup",
    "load_layer",
    "load_layers",
]
