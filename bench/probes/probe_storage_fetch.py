"""Where a file-backend fetch of DeepSeek-V3 pages spends its time, beside plain reads (one JSON line each).

Variants over the same files (page cache warm, destinations touched first): `raw` readinto into
distinct memory on N threads; `one_preadv_then_hash` HostStorageMover ReadPages as the tier is (the
first run's `kvtier` column; its `stretches_K` columns came from a reader, since removed, that
checksummed each K KiB stretch while in cache); `one_preadv_no_hash` the same reads with every
checksum taken as matching (what the hash costs).
Usage: python3 bench/probes/probe_storage_fetch.py [layout] [tokens]
"""

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from kvtier.cache.storage_mover import ReadPages, WritePages, open_storage
from kvtier.pool import HostPool
from kvtier.spec import preset
from kvtier.storage import values
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint

layout = sys.argv[1] if len(sys.argv) > 1 else "layer_first"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
spec = preset("deepseek-v3", page_size=64)
host = HostPool(spec, tokens, layout)
root = tempfile.mkdtemp(dir="/tmp")
setup = open_storage(StorageConfig(f"file://{root}"), host, Fingerprint.of("probe", spec))
hashes = setup.keys.chain(setup.keys.root, np.arange(tokens))
pages = list(zip(hashes, range(0, tokens, 64), strict=True))
setup.submit(WritePages(pages)).wait()
files = [setup.backend.path_of(k) for k in setup.keys.keys(hashes)]
sizes = [os.path.getsize(f) for f in files]
total = sum(sizes)
setup.close()


def timed(fn) -> float:
    fn()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def raw(threads: int) -> float:
    dst = np.ones(total, np.uint8)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    mv = memoryview(dst)

    def read(i):
        with open(files[i], "rb", buffering=0) as f:
            f.readinto(mv[offs[i] : offs[i + 1]])

    def run():
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(read, range(len(files))))

    return timed(run)


class _Matches(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class _NoHash:
    """Stands in for `xxhash` in `kvtier.storage.values`: no bytes hashed, every checksum matches."""

    class xxh3_64:  # the name it stands in for
        def update(self, view) -> None:
            pass

        def intdigest(self) -> int:
            return _Matches(0)


for workers in (4, 8):
    st = open_storage(StorageConfig(f"file://{root}", workers=workers), host, Fingerprint.of("probe", spec))
    out = {"layout": layout, "tokens": tokens, "workers": workers, "bytes": total, "cpus": os.cpu_count()}
    out["raw_gbps"] = total / raw(workers) / 1e9

    def fetch(st=st):
        f = st.submit(ReadPages(pages))
        f.wait()
        assert f.arrived() == len(pages)

    out["one_preadv_then_hash_gbps"] = total / timed(fetch) / 1e9  # the tier as it is
    values.xxhash = _NoHash  # the same reads, every checksum taken as matching
    out["one_preadv_no_hash_gbps"] = total / timed(fetch) / 1e9
    values.xxhash = xxhash
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
    st.close()
host.close()
