"""kvtier: a hierarchical KV cache for LLM serving.

KV of token prefixes lives in device memory, spills to pinned host memory, and
comes back at the PCIe line rate whatever the layout of its slots.

The names below are imported on first use, so `import kvtier` (and `kvtier --help`)
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "AllocPolicy": "kvtier.alloc",
    "HostSlotAllocator": "kvtier.alloc",
    "HostMemoryError": "kvtier.errors",
    "KVTierError": "kvtier.errors",
    "LayoutError": "kvtier.errors",
    "PinError": "kvtier.errors",
    "PlanError": "kvtier.errors",
    "SlotError": "kvtier.errors",
    "SpecError": "kvtier.errors",
    "DevicePool": "kvtier.pool",
    "HostLayout": "kvtier.pool",
    "HostPool": "kvtier.pool",
    "BufferKind": "kvtier.spec",
    "BufferSpec": "kvtier.spec",
    "KVSpec": "kvtier.spec",
    "preset": "kvtier.spec",
    "TransferPath": "kvtier.transfer",
    "TransferPlan": "kvtier.transfer",
    "backup": "kvtier.transfer",
    "load_layer": "kvtier.transfer",
    "load_layers": "kvtier.transfer",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
