"""Every exception kvtier raises: all are `KVTierError`, and each the built-in one it refines.

Errors are raised before any state changes and carry the offending values in their
message, so a caller can log one and go on with the cache intact.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class SpecError(KVTierError, ValueError):
    """A KV spec, or a pool built from one, is inconsistent."""


class SlotError(KVTierError, ValueError):
    """Slot ids handed to an allocator, a transfer or the cache are invalid."""


class LayoutError(KVTierError, ValueError):
    """A host layout name or a tensor layout is not one kvtier knows."""


class ConfigError(KVTierError, ValueError):
    """An option (of the cache, the engine, a kernel, a sampler) is out of its range."""


class HostMemoryError(KVTierError, MemoryError):
    """A host pool would not fit in the host's available memory."""


class PinError(KVTierError, RuntimeError):
    """Pinning host memory failed; kvtier never falls back to pageable memory."""


class PlanError(KVTierError, ValueError):
    """A transfer plan cannot apply: a forced path that does not fit, or pools it was not built for."""


class TransferError(KVTierError, ValueError):
    """Tensors or offsets handed to a transfer mechanism (kernel, batched DMA) do not fit it."""


class BackendUnavailableError(KVTierError, RuntimeError):
    """A mechanism needs something this process lacks (Triton, CUDA, a compiler)."""


class CudaRuntimeError(KVTierError, RuntimeError):
    """A raw CUDA runtime call returned an error code."""


class AllocatorCorruptError(KVTierError, RuntimeError):
    """The allocator's free structure names a page still allocated (its bug, raised before reuse)."""


class InvariantError(KVTierError, AssertionError):
    """An internal invariant does not hold (raised, never asserted: `python -O` keeps it)."""


class TransitionError(InvariantError):
    """A cache node was asked to move along a transition `kvtier.cache.states.TABLE` does not have."""


class RankError(KVTierError, RuntimeError):
    """A rank of a run over several processes failed (and the others were ended): its index and error."""


class LeaseError(KVTierError, RuntimeError):
    """A lease was released twice, or does not belong to this cache."""


class CacheStateError(KVTierError, RuntimeError):
    """A cache operation does not fit a node's state (evicted, loading, not on the host)."""


class CacheFullError(KVTierError, RuntimeError):
    """A tier has no room even after evicting every unlocked node."""


class ClosedError(KVTierError, RuntimeError):
    """A pool, cache or engine was used after `close()`."""


class StorageError(KVTierError, RuntimeError):
    """A storage backend failed (unreachable, full, a bad value); the storage tier counts it as a miss."""


class ModelLoadError(KVTierError, RuntimeError):
    """A model could not be found or loaded."""


class PromptTooLongError(KVTierError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context or the device pool."""


class BindError(KVTierError, OSError):
    """The server cannot listen on its address: the port is taken or not permitted, or the host is not this
    machine's."""


class APIError(KVTierError):
    """An HTTP request the server refuses: `status` and OpenAI's error `type`, `param`, `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """The JSON body OpenAI's API answers with."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
