"""Where kvtier's storage get loses to a plain read of the same files (FINDINGS, "The storage tier").

1. `checksum`: `kvtier.bench.storage_throughput.measure` (file backend, DeepSeek-V3 spec,
   pages 64 and 256, both host layouts) as it is, then with the payload checksum stubbed
   out (`xxhash.xxh3_64` in `kvtier.storage.values` replaced by a hasher that does nothing).
2. `gil`: xxh3 of four 64 MiB buffers on one thread, then on four threads.
3. `fused`: one 64 MiB file in the page cache read into memory alone, read then hashed,
   and read and hashed 256 KiB at a time.
4. `one_token_pages`: a fetch of 2048 one-token pages of the SmolLM2 shape (fp32,
   layer_first: 60 views per value, as the engine stores them) on 1 and 4 read workers.
5. `unplane`: one lz4 page of bf16 normal values (the SmolLM2 shape, 64 tokens): all of
   `PageCodec.check`, the decompression alone, and the two bytes of each value composed
   into the page as `lo | hi << 8` (what un-planing could be).

Usage: PYTHONPATH=. python bench/probes/probe_storage_get.py DIR > OUT.jsonl (one JSON line each).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvtier.bench import storage, storage_stores, storage_throughput
from kvtier.cache.storage_mover import open_storage
from kvtier.storage import values
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint, PageKeys

MIB = 1 << 20
XXH3 = xxhash.xxh3_64  # kept: the stub replaces the module's attribute, which values.xxhash is


class NoHash:
    def __init__(self, *_: object) -> None: ...

    def update(self, _: object) -> None: ...

    def intdigest(self) -> int:
        return 0


def checksum(root: Path) -> None:
    side = storage_stores.FileSide(root)
    for layout in ("layer_first", "page_first"):
        for ps in (64, 256):
            spec = storage.spec_of("deepseek-v3", ps)
            point = storage_throughput.Point(
                "deepseek-v3", spec, storage_throughput.pages_for(spec, 256 * MIB, 32), layout
            )
            for hashed in (True, False):
                values.xxhash.xxh3_64 = XXH3 if hashed else NoHash
                row = storage_throughput.measure(side, point, 3, False, 0)
                print(json.dumps({"probe": "checksum", "checksum": hashed, **asdict(row)}), flush=True)
    values.xxhash.xxh3_64 = XXH3


def gil() -> None:
    bufs = [np.random.default_rng(i).integers(0, 256, 64 * MIB, dtype=np.uint8) for i in range(4)]
    t0 = time.perf_counter()
    for b in bufs:
        xxhash.xxh3_64_intdigest(b)
    one = time.perf_counter() - t0
    threads = [threading.Thread(target=xxhash.xxh3_64_intdigest, args=(b,)) for b in bufs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    four = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "probe": "gil",
                "one_thread_gbps": 0.256 * 1.048576 / one,
                "four_threads_gbps": 0.256 * 1.048576 / four,
            }
        )
    )


def fused(root: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 64 * MIB, dtype=np.uint8)
    path = root / "fused.bin"
    path.write_bytes(data.tobytes())
    dst = memoryview(np.empty_like(data))
    piece = 256 << 10
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3):
            out = {"probe": "fused"}
            t0 = time.perf_counter()
            os.preadv(fd, [dst], 0)
            out["read_gbps"] = len(dst) / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            os.preadv(fd, [dst], 0)
            xxhash.xxh3_64_intdigest(dst)
            out["read_then_hash_gbps"] = len(dst) / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            h = xxhash.xxh3_64()
            for at in range(0, len(dst), piece):
                os.preadv(fd, [dst[at : at + piece]], at)
                h.update(dst[at : at + piece])
            out["read_and_hash_by_256k_gbps"] = len(dst) / (time.perf_counter() - t0) / 1e9
            print(json.dumps(out), flush=True)
    finally:
        os.close(fd)
        path.unlink()


def one_token_pages(root: Path) -> None:
    from kvtier.bench.served import model_config
    from kvtier.engine.hf import spec_from_hf_config

    spec = spec_from_hf_config(model_config("smollm2"), torch.float32, 1)
    pages = storage_throughput.PoolPages(spec, 2048, "layer_first", np.random.default_rng(0))
    fp = Fingerprint.of("probe", spec)
    keys = PageKeys(fp, 1)
    pairs = list(zip(keys.chain(keys.root, np.arange(2048)), pages.slots, strict=True))
    url = f"file://{tempfile.mkdtemp(dir=root)}"
    for workers in (1, 4):
        mover = open_storage(replace(StorageConfig(url), workers=workers), pages.pool, fp)
        mover.store(pairs).wait()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            f = mover.fetch(pairs)
            f.wait()
            times.append(time.perf_counter() - t0)
        mover.close()
        paths = storage_stores.store_files(Path(url[len("file://") :]))
        raw_s, nbytes = storage_stores.read_files(paths, workers, 16)
        print(
            json.dumps(
                {
                    "probe": "one_token_pages",
                    "workers": workers,
                    "values": len(pairs),
                    "value_bytes": nbytes // len(paths),
                    "fetch_s": sorted(times)[1],
                    "raw_read_s": raw_s,
                    "views_per_value": len(pages.pool.page_views(0)),
                }
            ),
            flush=True,
        )
    pages.pool.close()


def unplane() -> None:
    from kvtier.bench.served import model_config
    from kvtier.bench.storage_codec import _as_read
    from kvtier.engine.hf import spec_from_hf_config
    from kvtier.storage.config import Compression

    spec = spec_from_hf_config(model_config("smollm2"), torch.bfloat16, 64)
    n = spec.page_size * spec.bytes_per_token()
    page = torch.randn(n // 2).to(torch.bfloat16).view(torch.uint8).numpy()
    codec = values.PageCodec(spec, Fingerprint.of("probe", spec), Compression.LZ4)
    value = codec.encode(bytes(32), [memoryview(page)])
    dst = np.empty_like(page)
    out = {"probe": "unplane", "page_bytes": n}
    for name in ("check_s", "decompress_s", "compose_s"):
        best = float("inf")
        for _ in range(5):
            length, bufs = _as_read(codec, value, memoryview(dst))
            t0 = time.perf_counter()
            if name == "check_s":
                codec.check(bytes(32), length, bufs)
            elif name == "decompress_s":
                planes = values._decompress(Compression.LZ4, bytes(value[1]), n)
            else:  # each buffer's planes in turn, as `kvtier.storage.values` lays them out
                src, at = np.frombuffer(planes, np.uint8), 0
                for size in codec.buffer_bytes:
                    lo, hi = src[at : at + size].reshape(2, -1)
                    d16 = dst[at : at + size].view(np.uint16)
                    np.left_shift(hi, 8, out=d16, dtype=np.uint16)
                    d16 |= lo
                    at += size
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    out["composed_identical"] = bool(np.array_equal(dst, page))
    print(json.dumps(out))


if __name__ == "__main__":
    where = Path(tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None))
    checksum(where)
    gil()
    fused(where)
    one_token_pages(where)
    unplane()
