"""The storage tier's parts below the cache: page keys, page values, backends and their config.

`keys` names pages (a fingerprint, chained page hashes), `values` encodes and checks one
page's value, `backend` is the interface every store implements (`file`, `redis`, or a
class by module path) and `config` the tier's policies. The cache drives them through
`kvtier.cache.storage_mover.HostStorageMover`.
"""

from kvtier.storage.backend import StorageBackend, open_backend
from kvtier.storage.config import Compression, PrefetchPolicy, StorageConfig, StorageWrite
from kvtier.storage.keys import Fingerprint, PageKeys
from kvtier.storage.values import PageCodec

__all__ = [
    "Compression",
    "Fingerprint",
    "PageCodec",
    "PageKeys",
    "PrefetchPolicy",
    "StorageBackend",
    "StorageConfig",
    "StorageWrite",
    "open_backend",
]
