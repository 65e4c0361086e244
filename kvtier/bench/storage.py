"""`kvtier bench storage`: the storage tier's throughput, compression and TTFT, beside raw stores.

Parts (`Part`), each a table and a list in the JSON:

- `throughput` (`kvtier.bench.storage_throughput`): per backend (`file`; `redis` over
  `--redis URL`, else a `redis-server` this process starts), spec (`smollm2`: the SmolLM2-135M
  shape in bf16; `deepseek-v3`) and page size, kvtier's page put and get next to the raw
  store's, in one run, checked byte for byte before anything is timed.
- `compression` (`kvtier.bench.storage_codec`): ratio and one thread's encode and decode
  rate of `none`, `lz4` and `zstd` on the KV real SmolLM2 computes for a real text.
- `ttft` (`kvtier.bench.storage_ttft`): a storage hit (a new engine over the same file
  store, as after a restart) beside a host hit and a miss, with the storage read time
  against the raw read rate of the same run; the SmolLM2 shape by default, DeepSeek-V3's
  on CUDA.

Everything it writes goes under `root` (`--dir`, else a temporary directory), in a
directory of its own that is removed at the end. The page cache is warm unless
`drop_caches`. Measurements go to bench/FINDINGS.md, not here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path

import torch
from rich.console import Group
from rich.table import Table

from kvtier.bench import served, storage_codec, storage_throughput, storage_ttft
from kvtier.bench.common import Progress, collect, environment, quiet
from kvtier.bench.storage_stores import DROP_CACHES, FileSide, RedisSide, drop_page_cache, local_redis
from kvtier.engine.hf import spec_from_hf_config
from kvtier.errors import ConfigError
from kvtier.spec import preset
from kvtier.storage.config import StorageConfig

SPECS = ("smollm2", "deepseek-v3")
BACKENDS = ("file", "redis")


class Part(str, Enum):
    """What `kvtier bench storage` measures."""

    THROUGHPUT = "throughput"
    COMPRESSION = "compression"
    TTFT = "ttft"


@dataclass(frozen=True)
class StorageBench:
    """One run's parts and sizes; `quick()` gives a smoke test's."""

    root: Path
    parts: tuple[Part, ...] = tuple(Part)
    backends: tuple[str, ...] = BACKENDS
    specs: tuple[str, ...] = SPECS
    page_sizes: tuple[int, ...] = (16, 64, 256)
    layout: str = "layer_first"
    redis: str | None = None
    point_bytes: int = 256 << 20
    min_pages: int = 32
    repeats: int = 3
    compression_tokens: int = 4096
    tokens: tuple[int, ...] = (2048, 4096, 8192)
    setup: str = "smollm2"
    miss_repeats: int = 1
    drop_caches: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(Part(p) for p in self.parts))
        bad = {
            "backends": [b for b in self.backends if b not in BACKENDS],
            "specs": [s for s in (*self.specs, self.setup) if s not in SPECS],
            "page_sizes": [p for p in self.page_sizes if p < 1],
            "tokens": [n for n in self.tokens if n < 1],
            "counts": [n for n in (self.repeats, self.miss_repeats, self.min_pages) if n < 1],
        }
        if any(bad.values()):
            raise ConfigError(f"storage bench: unknown or below 1: { ({k: v for k, v in bad.items() if v}) }")

    def quick(self) -> StorageBench:
        """The same parts at smoke-test sizes (tiny points, one repeat, 256-token prefixes)."""
        return replace(
            self, point_bytes=1 << 20, min_pages=4, repeats=1, compression_tokens=256, tokens=(256,)
        )


def spec_of(setup: str, page_size: int):
    """The KV spec of a throughput point: the SmolLM2 shape in bf16, or the DeepSeek-V3 preset."""
    if setup == "deepseek-v3":
        return preset("deepseek-v3", page_size=page_size)
    if setup == "smollm2":
        return spec_from_hf_config(served.model_config("smollm2"), dtype=torch.bfloat16, page_size=page_size)
    raise ConfigError(f"unknown spec {setup!r}; known: {SPECS}")


def run(
    bench: StorageBench,
    progress: Progress = quiet,
    make_model: Callable | None = None,
    kv: Callable[[int, torch.device, Progress], storage_codec.KV] | None = None,
) -> dict:
    """Every part `bench` names; `{"meta", "skipped", "throughput", "compression", "ttft"}`.

    `make_model(setup, device)` builds the TTFT part's model (default: `bench.served.make_model`)
    and `kv(tokens, device, progress)` the compression part's KV (default: `storage_codec.real_kv`).
    """
    if bench.drop_caches and not drop_page_cache():
        raise ConfigError(f"--drop-caches: cannot write {DROP_CACHES} (it needs root)")
    defaults = StorageConfig("file://.")
    report: dict = {
        "meta": _meta(bench, defaults),
        "skipped": [],
        "throughput": [],
        "compression": [],
        "ttft": [],
    }
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-storage-", dir=bench.root))
    try:
        if Part.THROUGHPUT in bench.parts:
            report["throughput"] = _throughput(bench, work, report, progress)
        if Part.COMPRESSION in bench.parts:
            data = (kv or storage_codec.real_kv)(bench.compression_tokens, bench.device, progress)
            progress("compression: encoding and decoding pages")
            report["compression"] = storage_codec.measure(data, bench.page_sizes, bench.repeats)
            del data
        if Part.TTFT in bench.parts:
            report["ttft"] = _ttft(bench, work, make_model, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["meta"]["load_average_end"] = list(os.getloadavg())
    for part in Part:
        report[part.value] = [asdict(r) for r in report[part.value]]
    return report


def _meta(bench: StorageBench, defaults: StorageConfig) -> dict:
    return {
        **environment(bench.device),
        "cpus": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "parts": [p.value for p in bench.parts],
        "dir": str(bench.root),
        "page_cache": "dropped before each get" if bench.drop_caches else "warm",
        "layout": bench.layout,
        "repeats": bench.repeats,
        "point_bytes": bench.point_bytes,
        "min_pages": bench.min_pages,
        "tier": {k: getattr(defaults, k) for k in ("workers", "writers", "batch_pages")},
        "socket_timeout_s": storage_throughput.TIMEOUT_S,
        "miss_repeats": bench.miss_repeats,
    }


def _throughput(bench: StorageBench, work: Path, report: dict, progress: Progress) -> list:
    """The throughput rows of every backend that can run here (the others under `skipped`)."""
    rows = []
    for backend in bench.backends:
        with ExitStack() as stack:
            if backend == "file":
                side = FileSide(work / "throughput")
            elif bench.redis is not None:
                side = RedisSide(bench.redis)
            elif shutil.which("redis-server") is None:
                report["skipped"].append("throughput on redis: no --redis URL and no redis-server on PATH")
                continue
            else:
                side = RedisSide(stack.enter_context(local_redis()))
                report["meta"]["redis"] = "a redis-server started by the bench (no persistence)"
            stack.callback(side.close)
            if isinstance(side, RedisSide):
                report["meta"]["redis_version"] = side.client.info("server")["redis_version"]
            for setup in bench.specs:
                for ps in bench.page_sizes:
                    spec = spec_of(setup, ps)
                    pages = storage_throughput.pages_for(spec, bench.point_bytes, bench.min_pages)
                    progress(f"throughput, {backend}: {setup}, page {ps}, {pages} pages")
                    point = storage_throughput.Point(setup, spec, pages, bench.layout)
                    rows.append(
                        storage_throughput.measure(side, point, bench.repeats, bench.drop_caches, bench.seed)
                    )
                    collect()
    return rows


def _ttft(bench: StorageBench, work: Path, make_model: Callable | None, progress: Progress) -> list:
    progress(f"ttft: building the {bench.setup}-shaped model (random weights)")
    model = (make_model or served.make_model)(bench.setup, bench.device)
    plan = storage_ttft.TTFTPlan(
        bench.tokens, work, bench.repeats, bench.miss_repeats, bench.drop_caches, bench.layout
    )
    try:
        return storage_ttft.run_ttft(model, bench.setup, plan, progress)
    finally:
        del model
        collect()


# -- the tables ----------------------------------------------------------------------------


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(report: dict) -> Group:
    """A table per part that ran, with what was skipped."""
    meta, out = report["meta"], []
    if report["throughput"]:
        out += _throughput_table(report["throughput"], meta)
    if report["compression"]:
        out += _compression_table(report["compression"])
    if report["ttft"]:
        out += _ttft_table(report["ttft"], meta)
    out += [f"skipped: {s}" for s in report["skipped"]]
    return Group(*out)


def _throughput_table(rows: list[dict], meta: dict) -> list:
    t = Table(title=f"Page put and get, GB/s (median of {meta['repeats']}), kvtier beside the raw store")
    cols = ("backend", "spec", "page", "value MB", "pages", "put", "raw put", "ratio")
    for col in (*cols, "get", "raw get", "ratio", "check"):
        t.add_column(col, justify="left" if col in ("backend", "spec", "check") else "right")
    for r in rows:
        t.add_row(
            r["backend"],
            r["setup"],
            str(r["page_size"]),
            f"{r['value_bytes'] / 1e6:.2f}",
            str(r["pages"]),
            _gbps(r["kvtier_put_gbps"]),
            _gbps(r["raw_put_gbps"]),
            _gbps(r["put_ratio"]),
            _gbps(r["kvtier_get_gbps"]),
            _gbps(r["raw_get_gbps"]),
            _gbps(r["get_ratio"]),
            "identical" if r["identical"] else f"FAILED: {r['failure']}",
        )
    tier = meta["tier"]
    note = (
        f"raw: open/write and readinto of files of the same sizes under 2 levels of shards, or redis-py "
        f"SET/GET pipelines; both with the tier's {tier['writers']} write and {tier['workers']} read "
        f"threads, {tier['batch_pages']} values per batch; {meta['layout']} host pool; "
        f"page cache {meta['page_cache']}"
    )
    return [t, note]


def _compression_table(rows: list[dict]) -> list:
    t = Table(title=f"Compression of {rows[0]['kv']} KV ({rows[0]['dtype']}), one thread")
    for col in ("page", "compression", "page MB", "pages", "ratio", "encode GB/s", "decode GB/s", "check"):
        t.add_column(col, justify="left" if col in ("compression", "check") else "right")
    for r in rows:
        t.add_row(
            str(r["page_size"]),
            r["compression"],
            f"{r['page_bytes'] / 1e6:.2f}",
            str(r["pages"]),
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
            _gbps(r["encode_gbps"]),
            _gbps(r["decode_gbps"]),
            "identical" if r["identical"] else r["note"],
        )
    return [t, "ratio: payload stored / raw payload; decode: checksum, decompress, un-plane"]


def _ttft_table(rows: list[dict], meta: dict) -> list:
    what = f"{rows[0]['setup']} shape (random weights), page cache {rows[0]['page_cache']}"
    t = Table(title=f"TTFT, seconds, file backend, {what}")
    cols = ("prefix", "KV MB", "miss", "host hit", "storage hit", "hit tokens", "values", "read s")
    for col in (*cols, "raw GB/s", "read/raw", "same token"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["prefix_tokens"]),
            f"{r['kv_bytes'] / 1e6:.1f}",
            f"{r['ttft_miss_s']:.3f}",
            f"{r['ttft_host_hit_s']:.3f}",
            f"{r['ttft_storage_hit_s']:.3f}",
            str(r["storage_hit_tokens"]),
            f"{r['storage_values_read']} x {r['value_bytes'] / 1e3:.0f} kB",
            f"{r['storage_read_s']:.3f}",
            f"{r['raw_read_gbps']:.2f}",
            f"{r['read_vs_raw']:.2f}",
            "yes" if r["same_first_token"] else "NO",
        )
    note = (
        f"miss: median of {meta['miss_repeats']}, hits of {meta['repeats']}; storage hit: a new engine over "
        "the same store (as after a restart), prefetch wait_complete; read/raw: the tier's read time over "
        "(bytes read / the raw read rate of the same files in this run)"
    )
    return [t, note]


# -- the command ---------------------------------------------------------------------------
