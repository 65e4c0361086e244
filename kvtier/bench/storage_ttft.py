"""`kvtier bench storage`, TTFT: a storage hit beside a host hit and a miss, over the file backend.

For each prefix of `n` tokens (cut to the model's context as `kvtier bench served` cuts it),
on a store directory of its own:

1. an engine answers a prompt of `n + 16` tokens (a miss: the full prefill), then waits
   until its write-through values are stored (`flush`); before it, an engine without
   storage answers `miss_repeats - 1` other prompts of that length (more misses, whose
   values nothing would read);
2. it answers the prompt again `repeats` times, each after evicting every device page (host
   hits), and is closed;
3. `repeats` fresh engines over the same store, as after a restart, answer a short other
   prompt (so no row pays for an engine's first request), then the prompt: the prefix
   comes from storage (storage hits). Their prefetch policy is `wait_complete`, so a hit
   reads the whole prefix, not what arrived by a deadline.

`storage_read_s` is the prefetch's time (the tier's `prefetch_seconds`), `raw_read_gbps` the
rate of reading the same store's files plainly (`storage_stores.read_files`, the mover's
threads and batches) in the same run, and `read_vs_raw` = `storage_read_s` / (bytes read /
raw rate): 1.0 means the tier read its bytes at the raw rate. The page cache is warm (the
values were just written) unless `drop_caches`, which drops it before each storage hit and
each raw read. `same_first_token`: every storage hit's first token equals the miss's. A
warm-up round of 256 tokens (each kind of hit once, untimed) comes first, so no row pays
for compiling kernels. The models have random weights (timing only; see `bench.served`).
"""

from __future__ import annotations

import random
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.common import close, collect
from kvtier.bench.served import PROMPT_ROOM, fit_prefixes
from kvtier.bench.storage_stores import drop_page_cache, read_files, store_files
from kvtier.engine import Engine, RequestResult, SamplingParams
from kvtier.errors import ConfigError
from kvtier.spec import KVSpec
from kvtier.storage.config import PrefetchPolicy, StorageConfig

WARMUP_TOKENS = 256
QUESTION = 16  # tokens of each prompt past its prefix, as in `bench served`
PARAMS = SamplingParams(max_tokens=1)
WARM_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@dataclass
class TTFTRow:
    setup: str
    prefix_tokens: int
    kv_bytes: int
    page_size: int
    value_bytes: int
    page_cache: str
    ttft_miss_s: float
    ttft_host_hit_s: float
    ttft_storage_hit_s: float
    storage_hit_tokens: int
    storage_read_s: float
    storage_bytes_read: int
    storage_values_read: int
    raw_read_gbps: float
    read_vs_raw: float
    same_first_token: bool


@dataclass(frozen=True)
class StorageHit:
    """One storage hit: the request, and what its engine's tier read for it."""

    result: RequestResult
    read_s: float
    bytes_read: int
    values_read: int


@dataclass(frozen=True)
class TTFTPlan:
    """What the TTFT part measures: prefixes, samples, where the stores go, the page cache."""

    prefixes: tuple[int, ...]
    root: Path
    repeats: int = 3
    miss_repeats: int = 1
    drop_caches: bool = False
    layout: str = "layer_first"


def run_ttft(model, setup: str, plan: TTFTPlan, progress: Callable[[str], None]) -> list[TTFTRow]:
    """A row per prefix that fits `model` (after an untimed warm-up round)."""
    context = int(model.config.max_position_embeddings)
    rows = []
    progress(f"ttft, {setup}: warm-up of {WARMUP_TOKENS} tokens")
    measure_prefix(model, setup, WARMUP_TOKENS, TTFTPlan((), plan.root, 1, 1, False, plan.layout))
    for n in fit_prefixes(plan.prefixes, context, progress, setup):
        progress(f"ttft, {setup}: prefix of {n} tokens")
        rows.append(measure_prefix(model, setup, n, plan))
        collect()
    return rows


def measure_prefix(model, setup: str, n: int, plan: TTFTPlan) -> TTFTRow:
    """The miss, host-hit and storage-hit TTFTs of one prefix of `n` tokens; see the module docstring."""
    if n + PROMPT_ROOM > int(model.config.max_position_embeddings):
        raise ConfigError(f"a prefix of {n} tokens does not fit the model's context")
    store = plan.root / f"ttft-{setup}-{n}"
    shutil.rmtree(store, ignore_errors=True)
    config = StorageConfig(f"file://{store}", prefetch=PrefetchPolicy.WAIT_COMPLETE)
    rng = random.Random(n)
    vocab = int(model.config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(n + QUESTION)] for _ in range(plan.miss_repeats)]
    try:
        misses = _other_misses(model, prompts[:-1], n, plan.layout)
        miss, host, spec = _first_engine(model, config, prompts[-1], n, plan.repeats, plan.layout)
        hits = [
            _storage_hit(model, config, prompts[-1], n, plan.drop_caches, plan.layout)
            for _ in range(plan.repeats)
        ]
        raw = [_raw_read(store, config, plan.drop_caches) for _ in range(plan.repeats)]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return _row(setup, n, spec, plan, [*misses, miss], host, hits, raw)


def _other_misses(model, prompts: list[list[int]], n: int, layout: str) -> list[RequestResult]:
    """Misses of `prompts` on an engine without storage (theirs would be values nothing reads)."""
    if not prompts:
        return []
    with Engine(model, device_tokens=n + 256, host_tokens=n + 1024, host_layout=layout) as eng:
        return [eng.generate(p, PARAMS) for p in prompts]


def _first_engine(model, config: StorageConfig, prompt: list[int], n: int, repeats: int, layout: str):
    """`(the miss, host-hit TTFTs, the engine's spec)` of `prompt` on an engine over an empty store.

    The miss's values are stored before the host hits start (`flush`), and every write is
    finished when the engine is closed and collected here.
    """
    eng = Engine(model, device_tokens=n + 256, host_tokens=n + 1024, host_layout=layout, storage=config)
    try:
        miss = eng.generate(prompt, PARAMS)
        eng.cache.flush()
        host = []
        for _ in range(repeats):
            eng.cache.evict_device(10**9)
            host.append(eng.generate(prompt, PARAMS).ttft_s)
            eng.cache.flush()
        spec = eng.spec
    finally:
        close(eng)
    del eng
    collect()
    return miss, host, spec


def _storage_hit(
    model, config: StorageConfig, prompt: list[int], n: int, drop: bool, layout: str
) -> StorageHit:
    """The prompt on a fresh engine over the store, and what its tier read."""
    if drop:
        drop_page_cache()
    eng = Engine(model, device_tokens=n + 256, host_tokens=n + 1024, host_layout=layout, storage=config)
    try:
        eng.generate(WARM_PROMPT, PARAMS)  # a restarted server has answered something before
        result = eng.generate(prompt, PARAMS)
        m = eng.storage.metrics.snapshot()
    finally:
        close(eng)
    return StorageHit(result, m["prefetch_seconds"].sum, m["bytes_read"], m["pages_read"])


def _raw_read(store: Path, config: StorageConfig, drop: bool) -> float:
    """GB/s of reading every file of the store plainly, as the tier's readers would."""
    if drop:
        drop_page_cache()
    seconds, nbytes = read_files(store_files(store), config.workers, config.batch_pages)
    return nbytes / seconds / 1e9


def _row(setup: str, n: int, spec: KVSpec, plan: TTFTPlan, misses, host, hits, raw) -> TTFTRow:
    hit = sorted(hits, key=lambda h: h.result.ttft_s)[len(hits) // 2]  # the median hit, with its own read
    raw_gbps = statistics.median(raw)
    first = misses[-1].tokens[0]
    return TTFTRow(
        setup=setup,
        prefix_tokens=n,
        kv_bytes=n * spec.bytes_per_token(),
        page_size=spec.page_size,
        value_bytes=spec.page_size * spec.bytes_per_token(),
        page_cache="dropped" if plan.drop_caches else "warm",
        ttft_miss_s=round(statistics.median(m.ttft_s for m in misses), 5),
        ttft_host_hit_s=round(statistics.median(host), 5),
        ttft_storage_hit_s=round(hit.result.ttft_s, 5),
        storage_hit_tokens=hit.result.storage_hit_tokens,
        storage_read_s=round(hit.read_s, 5),
        storage_bytes_read=hit.bytes_read,
        storage_values_read=hit.values_read,
        raw_read_gbps=round(raw_gbps, 3),
        read_vs_raw=round(hit.read_s / (hit.bytes_read / (raw_gbps * 1e9)), 3) if hit.bytes_read else 0.0,
        same_first_token=all(h.result.tokens[:1] == [first] for h in hits),
    )
