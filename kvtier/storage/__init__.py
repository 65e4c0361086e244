"""The storage tier's parts below the cache: page keys, page values, backends and their config.

`keys` names pages (a fingerprint, chained page hashes), `values` encodes and checks one
page's value, `backend` is the interface every store implements (`file`, `redis`, or a
class by module path) and `config` the tier's policies. The cache drives them through
`kvtier.cache.storage_mover.HostStorageMover`. Nothing is imported here, so the CLI reads
`config` without torch; the public names are `kvtier`'s (`kvtier.StorageConfig`, ...).
"""
