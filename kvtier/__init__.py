"""kvtier: a hierarchical KV cache for LLM serving.

KV of token prefixes lives in device memory, spills to pinned host memory, and comes
back at the PCIe line rate whatever the layout of its slots. This module is the public
API: the spec and its presets, the pools, the slot allocator, transfer plans and their
execution, the cache (manager, config, eviction policies, movers), the engine and its
sampling parameters, model loading, and every error. Each name is imported on first
use, so `import kvtier` (and `kvtier --help`) imports neither torch nor transformers.

Type checkers read the same names from the `TYPE_CHECKING` block below (the package ships
`py.typed`). `__all__`, that block and `_MODULES` list the same names, each from the same
module (tests/test_cli.py checks it).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

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
    from kvtier.engine import Engine, RequestResult, SamplingParams, Update, spec_from_hf_config
    from kvtier.engine.models import load_model
    from kvtier.errors import (
        AllocatorCorruptError,
        APIError,
        BackendUnavailableError,
        BindError,
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
        StorageError,
        TransferError,
    )
    from kvtier.pool import DevicePool, HostLayout, HostPool
    from kvtier.pool.device import Direction
    from kvtier.spec import PRESETS, BufferKind, BufferSpec, KVSpec, preset
    from kvtier.storage.backend import StorageBackend, open_backend
    from kvtier.storage.config import Compression, PrefetchPolicy, StorageConfig, StorageWrite
    from kvtier.storage.keys import Fingerprint, PageKeys
    from kvtier.storage.values import PageCodec
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

try:
    __version__ = version("kvtier")  # the installed distribution's, from pyproject.toml
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_MODULES = {
    "kvtier.errors": (
        "APIError AllocatorCorruptError BackendUnavailableError BindError CacheFullError CacheStateError "
        "ClosedError ConfigError CudaRuntimeError HostMemoryError InvariantError KVTierError LayoutError "
        "LeaseError ModelLoadError PinError PlanError PromptTooLongError SlotError SpecError StorageError "
        "TransferError"
    ),
    "kvtier.spec": "PRESETS BufferKind BufferSpec KVSpec preset",
    "kvtier.alloc": "AllocPolicy HostSlotAllocator",
    "kvtier.pool": "DevicePool HostLayout HostPool",
    "kvtier.pool.device": "Direction",
    "kvtier.transfer": (
        "KernelOptions PathCosts Planner TransferPath TransferPlan backup load_layer load_layers"
    ),
    "kvtier.cache": (
        "LFU LRU CacheConfig CacheController CacheMetrics DeviceHostMover EvictionPolicy LoadHandle Match "
        "Mover PolicyName WritePolicy"
    ),
    "kvtier.storage.config": "Compression PrefetchPolicy StorageConfig StorageWrite",
    "kvtier.storage.backend": "StorageBackend open_backend",
    "kvtier.storage.keys": "Fingerprint PageKeys",
    "kvtier.storage.values": "PageCodec",
    "kvtier.engine": "Engine RequestResult SamplingParams Update spec_from_hf_config",
    "kvtier.engine.models": "load_model",
}
# Public name -> the module that defines it.
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = [
    "LFU",
    "LRU",
    "PRESETS",
    "APIError",
    "AllocPolicy",
    "AllocatorCorruptError",
    "BackendUnavailableError",
    "BindError",
    "BufferKind",
    "BufferSpec",
    "CacheConfig",
    "CacheController",
    "CacheFullError",
    "CacheMetrics",
    "CacheStateError",
    "ClosedError",
    "Compression",
    "ConfigError",
    "CudaRuntimeError",
    "DeviceHostMover",
    "DevicePool",
    "Direction",
    "Engine",
    "EvictionPolicy",
    "Fingerprint",
    "HostLayout",
    "HostMemoryError",
    "HostPool",
    "HostSlotAllocator",
    "InvariantError",
    "KVSpec",
    "KVTierError",
    "KernelOptions",
    "LayoutError",
    "LeaseError",
    "LoadHandle",
    "Match",
    "ModelLoadError",
    "Mover",
    "PageCodec",
    "PageKeys",
    "PathCosts",
    "PinError",
    "PlanError",
    "Planner",
    "PolicyName",
    "PrefetchPolicy",
    "PromptTooLongError",
    "RequestResult",
    "SamplingParams",
    "SlotError",
    "SpecError",
    "StorageBackend",
    "StorageConfig",
    "StorageError",
    "StorageWrite",
    "TransferError",
    "TransferPath",
    "TransferPlan",
    "Update",
    "WritePolicy",
    "backup",
    "load_layer",
    "load_layers",
    "load_model",
    "open_backend",
    "preset",
    "spec_from_hf_config",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
