"""kvtier: a hierarchical KV cache for LLM serving.

KV of token prefixes lives in device memory, spills to pinned host memory, and comes
back at the PCIe line rate whatever the layout of its slots. This module is the public
API: the spec and its presets, the pools, the slot allocator, transfer plans and their
execution, the cache (manager, config, policies, movers), the engine, and every error.
The engine's names (`Engine`, `SamplingParams`, `load_model`, `KVTierCache`) import
transformers only when first used.
"""

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

__version__ = "0.1.0"

_ENGINE = {
    "Engine": "kvtier.engine.engine",
    "SamplingParams": "kvtier.engine.engine",
    "RequestResult": "kvtier.engine.engine",
    "KVTierCache": "kvtier.engine.hf",
    "spec_from_hf_config": "kvtier.engine.hf",
    "load_model": "kvtier.engine.models",
}


def __getattr__(name: str):
    if name in _ENGINE:
        import importlib

        return getattr(importlib.import_module(_ENGINE[name]), name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")


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
