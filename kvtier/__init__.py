"""kvtier: a hierarchical KV cache for LLM serving.

KV of token prefixes lives in device memory, spills to pinned host memory, and
comes back at the PCIe line rate whatever the layout of its slots.
"""

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.errors import (
    HostMemoryError,
    KVTierError,
    LayoutError,
    PinError,
    PlanError,
    SlotError,
    SpecError,
)
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.spec import BufferKind, BufferSpec, KVSpec, preset
from kvtier.transfer import TransferPath, TransferPlan, backup, load_layer, load_layers

__version__ = "0.1.0"

__all__ = [
    "AllocPolicy",
    "BufferKind",
    "BufferSpec",
    "DevicePool",
    "HostLayout",
    "HostMemoryError",
    "HostPool",
    "HostSlotAllocator",
    "KVSpec",
    "KVTierError",
    "LayoutError",
    "PinError",
    "PlanError",
    "SlotError",
    "SpecError",
    "TransferPath",
    "TransferPlan",
    "backup",
    "load_layer",
    "load_layers",
    "preset",
]
