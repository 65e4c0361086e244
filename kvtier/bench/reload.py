"""`kvtier bench cache --parts reload`: a long prefix evicted to the host and loaded back.

A `tokens`-long sequence is inserted, backed up and evicted to the host, then
`match` + `load_back` are timed `repeats` times: the host (CPU) time of the calls,
and on CUDA the time until the first and the last layer have landed, against the
ceiling of one contiguous pinned copy of the same bytes measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from rich.console import Group
from rich.table import Table

from kvtier.bench.churn import leave_free_runs
from kvtier.bench.common import Progress, ceiling_gbps, close, quiet, write_random_kv
from kvtier.bench.trace import VOCAB
from kvtier.cache import CacheConfig, CacheController, WritePolicy
from kvtier.errors import ConfigError, InvariantError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import KVSpec

RELOAD_CPU_TARGET_US = 1000.0
RELOAD_RATIO_TARGET = 1.1


@dataclass
class ReloadRow:
    spec: str
    layers: int
    device: str
    tokens: int
    loaded_bytes: int  # per reload, from the controller's counters
    repeats: int
    query_ids: str  # dtype of the ids passed to match (engines commonly hold int32)
    host_runs: int  # runs the prefix's host copy lies in
    host_layout: str  # the host pool's layout
    cpu_us: float  # median process time (all threads, the loop's own included) of match + load_back
    thread_us: float  # median CPU time of the calling thread alone, same calls (what cpu_met is of)
    wall_us: float  # median wall time of the same
    match_us: float  # median wall time of match alone
    target_cpu_us: float
    cpu_met: bool
    reload_ms: float | None = None  # CUDA: load_back called -> last layer's signal fired
    # CUDA: load_back called -> first layer's signal fired (polled once load_back has returned)
    first_layer_ms: float | None = None
    ceiling_gbps: float | None = None  # CUDA: one contiguous pinned copy of one layer's bytes
    ideal_ms: float | None = None  # loaded bytes at the ceiling
    ratio: float | None = None  # reload_ms / ideal_ms
    ratio_met: bool | None = None
    # CUDA, write-through: insert called -> the backup of the whole prefix completed (median of 3),
    # and that against the device -> host ceiling (one contiguous pinned copy) of the same run.
    backup_ms: float | None = None
    backup_ceiling_gbps: float | None = None
    backup_ratio: float | None = None
    samples: list[dict[str, float]] = field(default_factory=list)


def run_prefix_reload(
    spec: KVSpec,
    tokens: int = 131072,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
    seed: int = 0,
    progress: Progress = quiet,
    query_ids: str = "int32",
    host_runs: int = 1,
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST,
) -> ReloadRow:
    """Insert a `tokens`-long sequence, evict it to the host, then time match + load_back `repeats` times.

    `query_ids`: the dtype of the ids given to `match` (`int32` or `int64`). `host_runs`:
    the host copy of the prefix lies in this many runs (the host pool is fragmented
    before the write-through backup, as after churn), so every layer loads in as many
    copies. `host_layout`: the host pool's layout.
    """
    device = torch.device(device)
    layout = _checked(spec, tokens, host_runs, host_layout)
    progress(f"reload: pools of {tokens} slots ({tokens * spec.bytes_per_token() / 1e9:.2f} GB per tier)")
    config = CacheConfig(write_policy=WritePolicy(policy))
    cache, backups = _cache_for(spec, tokens, device, config, host_runs, layout, seed, query_ids)
    try:
        node, ids = _prefix_in_cache(cache, tokens, seed, query_ids, host_runs)
        cuda = device.type == "cuda"
        ceiling = ceiling_gbps(device, tokens * spec.layer_bytes_per_token(0)) if cuda else None
        back = (
            ceiling_gbps(device, tokens * spec.layer_bytes_per_token(0), Direction.BACKUP)
            if backups
            else None
        )
        samples, loaded_bytes = [], 0
        for r in range(repeats):
            progress(f"reload: repeat {r + 1}/{repeats}")
            sample, loaded_bytes = _reload_once(cache, node, ids, host_runs)
            samples.append(sample)
        cache.flush()
    finally:
        close(cache, cache.host_pool, cache.device_pool)
    row = ReloadRow(
        spec=spec.name,
        layers=spec.num_layers,
        device=str(device),
        tokens=tokens,
        loaded_bytes=loaded_bytes,
        repeats=repeats,
        query_ids=query_ids,
        host_runs=host_runs,
        host_layout=layout.value,
        cpu_us=_median(samples, "cpu_us"),
        thread_us=_median(samples, "thread_us"),
        wall_us=_median(samples, "wall_us"),
        match_us=_median(samples, "match_us"),
        target_cpu_us=RELOAD_CPU_TARGET_US,
        cpu_met=_median(samples, "thread_us") <= RELOAD_CPU_TARGET_US,
        samples=samples,
    )
    if ceiling is not None:
        _add_device_times(row, samples, ceiling, backups, back)
    return row


def _checked(spec: KVSpec, tokens: int, host_runs: int, host_layout: HostLayout | str) -> HostLayout:
    """`run_prefix_reload`'s arguments checked before any pool is built; the host layout."""
    ps = spec.page_size
    if tokens <= 0 or host_runs < 1 or tokens % (ps * host_runs):
        raise ConfigError(
            f"tokens {tokens} must be a positive multiple of the page size {ps} times host_runs {host_runs}"
        )
    return HostLayout.parse(host_layout)


def _add_device_times(
    row: ReloadRow, samples: list[dict], ceiling: float, backups: list[float], back: float | None
) -> None:
    """Fill the CUDA fields of `row`: the reload against `ceiling`, the backups against `back` (GB/s)."""
    row.reload_ms = _median(samples, "reload_ms")
    row.first_layer_ms = _median(samples, "first_layer_ms")
    row.ceiling_gbps = round(ceiling, 2)
    row.ideal_ms = round(row.loaded_bytes / (ceiling * 1e9) * 1e3, 3)
    row.ratio = round(row.reload_ms / row.ideal_ms, 3)
    row.ratio_met = row.ratio <= RELOAD_RATIO_TARGET
    if backups and back is not None:
        row.backup_ms = round(statistics.median(backups), 3)
        row.backup_ceiling_gbps = round(back, 2)
        row.backup_ratio = round(row.backup_ms / (row.loaded_bytes / (back * 1e9) * 1e3), 3)


def _cache_for(
    spec: KVSpec,
    tokens: int,
    device: torch.device,
    config: CacheConfig,
    host_runs: int,
    layout: HostLayout,
    seed: int,
    query_ids: str,
) -> tuple[CacheController, list[float]]:
    """A cache with room for one `tokens`-long prefix, and on CUDA with write-through the times of
    three whole-prefix backups through it (ms from `insert` until the backup completed)."""
    ps = spec.page_size
    cache = CacheController(
        DevicePool(spec, tokens, device), HostPool(spec, tokens + (host_runs - 1) * ps, layout), config
    )
    backups: list[float] = []
    if device.type != "cuda" or config.write_policy is not WritePolicy.WRITE_THROUGH:
        return cache, backups
    for r in range(3):
        ids = np.random.default_rng(seed + 1 + r).integers(1, VOCAB, tokens).astype(query_ids)
        slots = cache.alloc_device(tokens)
        write_random_kv(cache.device_pool, slots, torch.Generator(device=device).manual_seed(seed + 1 + r))
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        cache.insert(ids, slots)
        cache.flush()
        backups.append((time.perf_counter() - t0) * 1e3)
        cache.evict_device(tokens)
        cache.evict_host(tokens)
    return cache, backups


def _prefix_in_cache(
    cache: CacheController, tokens: int, seed: int, query_ids: str, host_runs: int
) -> tuple[object, np.ndarray]:
    """Put one `tokens`-long prefix of random KV in `cache`, backed up in `host_runs` host runs.

    Returns the prefix's node and its ids (`[tokens]` of dtype `query_ids`).
    """
    ps, device = cache.spec.page_size, cache.device_pool.device
    leave_free_runs(cache.host_alloc, tokens // host_runs, host_runs, ps)
    # The ids as an engine holds them, in one dtype for insert and match.
    ids = np.random.default_rng(seed).integers(1, VOCAB, tokens).astype(query_ids)
    slots = cache.alloc_device(tokens)
    write_random_kv(cache.device_pool, slots, torch.Generator(device=device).manual_seed(seed))
    node = cache.insert(ids, slots)
    cache.flush()  # the write-through backup, which would share the link with the ceiling's copies
    return node, ids


def _reload_once(cache: CacheController, node, ids: np.ndarray, host_runs: int) -> tuple[dict, int]:
    """Evict the prefix to the host, then one timed match + load_back: `(sample, bytes loaded)`."""
    # A new request's ids, as an engine holds them when it calls match (made before the
    # timed calls: building them from Python ints is the tokenizer's cost, not the cache's).
    query = ids.copy()
    tokens = len(ids)
    device = cache.device_pool.device
    cache.flush()  # the write-through backup (or the last reload) completes
    cache.evict_device(tokens)
    if node.host_runs is None or len(node.host_runs) != host_runs:
        raise InvariantError(f"the prefix's host copy is in {node.host_runs} runs, not {host_runs}")
    before = cache.metrics.bytes_h2d
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
    m = cache.match(query)
    w1 = time.perf_counter()
    h = cache.load_back(m)
    c2, t2, w2 = time.process_time(), time.thread_time(), time.perf_counter()
    sample = {
        "cpu_us": (c2 - c0) * 1e6,
        "thread_us": (t2 - t0) * 1e6,
        "wall_us": (w2 - w0) * 1e6,
        "match_us": (w1 - w0) * 1e6,
    }
    if device.type == "cuda":
        first, last = _poll_layers(h)
        sample["first_layer_ms"] = (first - w1) * 1e3
        sample["reload_ms"] = (last - w1) * 1e3
    h.wait()
    if h.tokens != tokens:
        raise InvariantError(f"reload moved {h.tokens} tokens, expected {tokens} (host copy missing?)")
    return {k: round(v, 3) for k, v in sample.items()}, cache.metrics.bytes_h2d - before


def _median(samples: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(s[key] for s in samples), 3)


def _poll_layers(h) -> tuple[float, float]:
    """Spin on the host until the first and the last layer's signals fire; their perf_counter times."""
    first_sig, last_sig = h.layer_signals[0], h.layer_signals[-1]
    first = None
    while True:
        now = time.perf_counter()
        if first is None and first_sig.query():
            first = now
        if last_sig.query():
            return (first if first is not None else now), now


def render(row: ReloadRow, meta: dict) -> Group:
    """The reload's table: host cost of the calls, and on CUDA the reload against the ceiling."""

    def na(x, fmt="{:.2f}"):
        return "n/a" if x is None else fmt.format(x)

    r = row
    table = Table(
        title=f"match + load_back of a {r.tokens}-token prefix from the host: {r.spec} x {r.layers} "
        f"layers, {r.loaded_bytes / 1e9:.3f} GB in {r.host_runs} host runs ({r.host_layout}), "
        f"{r.query_ids} ids, median of {r.repeats}, "
        f"on {meta.get('gpu') or meta.get('cpu')}"
    )
    cols = ("CPU us", "thread us", "wall us", "match us", "thread <= 1 ms", "reload ms", "first layer ms")
    cols += ("ceiling GB/s", "ideal ms", "ratio", "ratio <= 1.1", "backup ms", "backup ratio")
    for col in cols:
        table.add_column(col, justify="right")
    table.add_row(
        f"{r.cpu_us:.0f}",
        f"{r.thread_us:.0f}",
        f"{r.wall_us:.0f}",
        f"{r.match_us:.0f}",
        "yes" if r.cpu_met else "[red]no[/red]",
        na(r.reload_ms),
        na(r.first_layer_ms),
        na(r.ceiling_gbps, "{:.1f}"),
        na(r.ideal_ms),
        na(r.ratio, "{:.3f}"),
        "n/a" if r.ratio_met is None else ("yes" if r.ratio_met else "[red]no[/red]"),
        na(r.backup_ms, "{:.1f}"),
        na(r.backup_ratio, "{:.3f}"),
    )
    note = (
        "CPU: process time (all threads) of match + load_back submission; thread: the caller's alone; "
        "reload: load_back called until the last layer's signal fired; ideal: the loaded bytes at the "
        "ceiling (one pinned copy); backup: insert called until its write-through backup completed, "
        "against the device -> host ceiling"
    )
    return Group(table, note)
