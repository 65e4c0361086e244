"""Where a file-backend fetch of DeepSeek-V3 pages spends its time, beside plain reads (one JSON line each).

Variants over the same files (page cache warm, destinations touched first): `raw` readinto into
distinct memory on N threads; `kvtier` HostStorageMover.fetch as configured; `stretches_K` read in
stretches of K KiB, each checksummed while in cache;
`no_hash` the same reads with the checksum taken from the header (what the hash costs); `one_preadv`
each value read by one preadv into the pool's views, no hash (what reading in stretches costs).
Usage: python3 bench/probes/probe_storage_fetch.py [layout] [tokens]
"""

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.cache.storage_mover import open_storage
from kvtier.pool import HostPool
from kvtier.spec import preset
from kvtier.storage import file as file_backend
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
setup.store(pages).wait()
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


for workers in (4, 8):
    st = open_storage(StorageConfig(f"file://{root}", workers=workers), host, Fingerprint.of("probe", spec))
    out = {"layout": layout, "tokens": tokens, "workers": workers, "bytes": total, "cpus": os.cpu_count()}
    out["raw_gbps"] = total / raw(workers) / 1e9

    def fetch(st=st):
        f = st.fetch(pages)
        f.wait()
        assert f.arrived() == len(pages)

    out["kvtier_gbps"] = total / timed(fetch) / 1e9  # as configured (file.FileBackend.streams_pieces)
    st.backend.streams_pieces = True  # read in stretches, each checksummed while in cache
    for piece in (256 << 10, 1 << 20, 4 << 20):
        file_backend.PIECE_BYTES = piece
        out[f"stretches_{piece >> 10}k_gbps"] = total / timed(fetch) / 1e9
    st.backend.streams_pieces = False  # one preadv a value, then the checksum in a second pass
    out["one_preadv_then_hash_gbps"] = total / timed(fetch) / 1e9
    codec_check = st.codec.check

    def header_checksum(h, n, b, d=None, check=codec_check):
        return check(h, n, b, int.from_bytes(bytes(b[0][24:32]), "little"))

    st.codec.check = header_checksum
    out["one_preadv_no_hash_gbps"] = total / timed(fetch) / 1e9
    st.codec.check = codec_check
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
    st.close()
host.close()
