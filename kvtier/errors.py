"""Exception types of kvtier.

Every error is raised before any state changes and carries the offending values
in its message, so a caller can log it and go on with the cache intact.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class SpecError(KVTierError, ValueError):
    """A KV spec, or a pool built from one, is inconsistent."""


class SlotError(KVTierError, ValueError):
    """Slot ids handed to an allocator or a transfer are invalid."""


class LayoutError(KVTierError, ValueError):
    """A host layout name or a tensor layout is not one kvtier knows."""


class HostMemoryError(KVTierError, MemoryError):
    """A host pool would not fit in the host's available memory."""


class PinError(KVTierError, RuntimeError):
    """Pinning host memory failed; kvtier never falls back to pageable memory."""


class PlanError(KVTierError, ValueError):
    """A transfer path was forced where it cannot apply."""


class AllocatorCorruptError(KVTierError, RuntimeError):
    """The allocator's free structure names a page that is still allocated.

    This is a bug in the allocator, not in the caller: the free structure and the
    ownership array disagree. It is raised before the page is handed out twice.
    """


class LeaseError(KVTierError, RuntimeError):
    """A lease was released twice, or does not belong to this cache."""


class CacheStateError(KVTierError, RuntimeError):
    """A cache operation does not fit a node's state (evicted, loading, not on the host)."""


class CacheFullError(KVTierError, RuntimeError):
    """A tier has no room even after evicting every unlocked node."""
