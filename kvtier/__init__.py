"""kvtier: a hierarchical KV cache for LLM serving.

KV of token prefixes lives in device memory, spills to pinned host memory, and comes
back at the PCIe line rate whatever the layout of its slots. This module is the public
API: the spec and its presets, the pools, the slot allocator, transfer plans and their
execution, the cache (manager, config, eviction policies, movers), the engine and its
sampling parameters, model loading, and every error.

Errors are imported with the package; every other name on first use, so `import kvtier`
(and `kvtier --help`) imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.errors import (
    AllocatorCorruptError,
    APIError,
    BackendUnavailableError,
    CacheFullError,
    CacheStateError,
    ClosedError,
    ConfigError,
    CudaRuntimeError,
    HostMemoryError,
    InvariantError,
    KVTierError,
    LayoutError,
    LeaseError,
    ModelLoadError,
    PinError,
    PlanError,
    PromptTooLongError,
    SlotError,
    SpecError,
    TransferError,
)

__version__ = "0.1.0"

_MODULES = {
    "kvtier.spec": ("PRESETS", "BufferKind", "BufferSpec", "KVSpec", "preset"),
    "kvtier.alloc": ("AllocPolicy", "HostSlotAllocator"),
    "kvtier.pool": ("DevicePool", "HostLayout", "HostPool"),
    "kvtier.pool.device": ("Direction",),
    "kvtier.transfer": (
        "KernelOptions",
        "PathCosts",
        "Planner",
        "TransferPath",
        "TransferPlan",
        "backup",
        "load_layer",
        "load_layers",
    ),
    "kvtier.cache": (
        "LFU",
        "LRU",
        "CacheConfig",
        "CacheController",
        "CacheMetrics",
        "DeviceHostMover",
        "EvictionPolicy",
        "LoadHandle",
        "Match",
        "Mover",
        "PolicyName",
        "WritePolicy",
    ),
    "kvtier.engine": ("Engine", "KVTierCache", "RequestResult", "SamplingParams", "spec_from_hf_config"),
    "kvtier.engine.models": ("load_model",),
}
# Public name -> the module that defines it.
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "LFU",
    "LRU",
    "PRESETS",
    "APIError",
    "AllocPolicy",
    "AllocatorCorruptError",
    "BackendUnavailableError",
    "BufferKind",
    "BufferSpec",
    "CacheConfig",
    "CacheController",
    "CacheFullError",
    "CacheMetrics",
    "CacheStateError",
    "ClosedError",
    "ConfigError",
    "CudaRuntimeError",
    "DeviceHostMover",
    "DevicePool",
    "Direction",
    "Engine",
    "EvictionPolicy",
    "HostLayout",
    "HostMemoryError",
    "HostPool",
    "HostSlotAllocator",
    "InvariantError",
    "KVSpec",
    "KVTierCache",
    "KVTierError",
    "KernelOptions",
    "LayoutError",
    "LeaseError",
    "LoadHandle",
    "Match",
    "ModelLoadError",
    "Mover",
    "PathCosts",
    "PinError",
    "PlanError",
    "Planner",
    "PolicyName",
    "PromptTooLongError",
    "RequestResult",
    "SamplingParams",
    "SlotError",
    "SpecError",
    "TransferError",
    "TransferPath",
    "TransferPlan",
    "WritePolicy",
    "backup",
    "load_layer",
    "load_layers",
    "load_model",
    "preset",
    "spec_from_hf_config",
]

if TYPE_CHECKING:
    from kvtier.alloc import AllocPolicy, HostSlotAllocator
    from kvtier.cache import (
        LFU,
        LRU,
        CacheConfig,
        CacheController,
        CacheMetrics,
        DeviceHostMover,
        EvictionPolicy,
        LoadHandle,
        Match,
        Mover,
        PolicyName,
        WritePolicy,
    )
    from kvtier.engine import Engine, KVTierCache, RequestResult, SamplingParams, spec_from_hf_config
    from kvtier.engine.models import load_model
    from kvtier.pool import DevicePool, HostLayout, HostPool
    from kvtier.pool.device import Direction
    from kvtier.spec import PRESETS, BufferKind, BufferSpec, KVSpec, preset
    from kvtier.transfer import (
        KernelOptions,
        PathCosts,
        Planner,
        TransferPath,
        TransferPlan,
        backup,
        load_layer,
        load_layers,
    )
