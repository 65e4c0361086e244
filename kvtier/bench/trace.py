"""`kvtier bench cache --parts trace`: a synthetic multi-turn chat trace under device-memory pressure.

A few system prompts and long documents are shared by many conversations; turn t's
prompt is turn t-1's prompt and answer plus a new user message. The device pool holds
only a few conversations, so earlier turns are evicted to the host and loaded back.
Per write policy: hit ratios per tier, bytes moved each way, evictions,
fragmentation, and the host (CPU) cost of each controller call.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, fields

import numpy as np
import torch
from rich.console import Group
from rich.table import Table

from kvtier.bench.common import OpStat, Progress, environment, op_stat, quiet, write_random_kv
from kvtier.cache import CacheConfig, CacheController, WritePolicy
from kvtier.errors import ConfigError, InvariantError
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)

OPS = ("match", "acquire", "load_back", "alloc_device", "insert", "release")
VOCAB = 128_000


@dataclass(frozen=True)
class TraceConfig:
    """Sizes of the synthetic trace and of the pools it runs against (lengths in tokens)."""

    spec: KVSpec
    device: torch.device
    device_slots: int = 65536
    host_slots: int = 262144
    conversations: int = 64
    turns: int = 8
    active: int = 8  # conversations in progress at once; the next turn is one of theirs at random
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (1024, 2048)
    documents: int = 4
    document_tokens: tuple[int, int] = (8192, 32768)
    quote_share: float = 0.5  # share of conversations that quote a document in their first turn
    user_tokens: tuple[int, int] = (32, 512)
    answer_tokens: tuple[int, int] = (64, 512)
    flush_every: int = 8  # CPU only: run the queued backups every this many requests
    write_kv: bool = True  # write random bytes for each request's new tokens, as the model would
    seed: int = 0


@dataclass(frozen=True)
class Request:
    conversation: int
    turn: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass
class TraceRow:
    policy: str
    requests: int
    prompt_tokens: int
    device_hit: float  # shares of all prompt tokens
    host_hit: float
    miss: float
    loads: int
    loaded_tokens: int
    recomputed_tokens: int
    bytes_h2d: int
    bytes_d2h: int
    backups: int
    backups_skipped: int
    device_evictions: int
    device_evicted_tokens: int
    host_evictions: int
    dropped_tokens: int
    fragmentation: dict[str, int]
    ops: list[OpStat]
    seconds: float


@dataclass
class TraceResult:
    row: TraceRow
    cache: CacheController  # for invariant checks after the run


def make_trace(cfg: TraceConfig) -> list[Request]:
    """The requests of the trace, in arrival order (seeded, whole pages)."""
    rng = np.random.default_rng(cfg.seed)
    ps = cfg.spec.page_size

    def tokens(lo_hi: tuple[int, int]) -> tuple[int, ...]:
        n = int(rng.integers(lo_hi[0], lo_hi[1] + 1))
        n = max(ps, -(-n // ps) * ps)
        return tuple(rng.integers(1, VOCAB, n).tolist())

    systems = [tokens(cfg.system_tokens) for _ in range(cfg.system_prompts)]
    docs = [tokens(cfg.document_tokens) for _ in range(cfg.documents)]
    conversations: list[list[Request]] = []
    for c in range(cfg.conversations):
        history = systems[int(rng.integers(len(systems)))] if systems else ()
        if docs and rng.random() < cfg.quote_share:
            history += docs[int(rng.integers(len(docs)))]
        turns = []
        for t in range(cfg.turns):
            prompt = history + tokens(cfg.user_tokens)
            answer = tokens(cfg.answer_tokens)
            turns.append(Request(c, t, prompt, answer))
            history = prompt + answer
        conversations.append(turns)

    order: list[Request] = []
    waiting = deque(range(cfg.conversations))
    active: list[list[int]] = []  # [conversation, next turn]
    while waiting or active:
        while waiting and len(active) < cfg.active:
            active.append([waiting.popleft(), 0])
        i = int(rng.integers(len(active)))
        c, t = active[i]
        order.append(conversations[c][t])
        if t + 1 == cfg.turns:
            active.pop(i)
        else:
            active[i][1] += 1
    return order


def check_fits(cfg: TraceConfig, trace: list[Request]) -> None:
    """`ConfigError` unless every request of `trace`, prompt and answer, fits the device pool."""
    longest = max(len(r.prompt) + len(r.answer) for r in trace)
    if longest > cfg.device_slots:
        raise ConfigError(
            f"the longest request ({longest} tokens) does not fit {cfg.device_slots} device slots"
        )


def build_pools(cfg: TraceConfig) -> tuple[DevicePool, HostPool]:
    """Pools for the trace; a controller per policy can reuse them (it owns only the slot maps)."""
    dev = DevicePool(cfg.spec, cfg.device_slots, cfg.device)
    host = HostPool(cfg.spec, cfg.host_slots)
    return dev, host


def run_trace(
    cfg: TraceConfig,
    policy: WritePolicy | str,
    pools: tuple[DevicePool, HostPool] | None = None,
    progress: Progress = quiet,
) -> TraceResult:
    """Serve the whole trace through a fresh controller with `policy`; one row of results."""
    policy = WritePolicy(policy)
    trace = make_trace(cfg)
    check_fits(cfg, trace)
    dev, host = pools or build_pools(cfg)
    cache = CacheController(dev, host, CacheConfig(write_policy=policy))
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    times: dict[str, list[float]] = {op: [] for op in OPS}
    cpu = cfg.device.type != "cuda"
    prompt_tokens = 0
    t_start = time.perf_counter()
    for i, req in enumerate(trace):
        if i % 50 == 0:
            progress(f"{policy.value}: request {i}/{len(trace)}")
        _serve(cache, req, times, gen if cfg.write_kv else None)
        prompt_tokens += len(req.prompt)
        if cpu and (i + 1) % cfg.flush_every == 0:
            cache.flush()
    cache.flush()
    seconds = time.perf_counter() - t_start

    m = cache.metrics
    hits = m.device_hit_tokens + m.host_hit_tokens + m.miss_tokens
    if hits != prompt_tokens:
        raise InvariantError(f"hits, host hits and misses count {hits} tokens, the prompts {prompt_tokens}")
    row = TraceRow(
        policy=policy.value,
        requests=len(trace),
        prompt_tokens=prompt_tokens,
        device_hit=m.device_hit_tokens / prompt_tokens,
        host_hit=m.host_hit_tokens / prompt_tokens,
        miss=m.miss_tokens / prompt_tokens,
        loads=m.loads,
        loaded_tokens=m.loaded_tokens,
        recomputed_tokens=m.recomputed_tokens,
        bytes_h2d=m.bytes_h2d,
        bytes_d2h=m.bytes_d2h,
        backups=m.backups,
        backups_skipped=m.backups_skipped,
        device_evictions=m.device_evictions,
        device_evicted_tokens=m.device_evicted_tokens,
        host_evictions=m.host_evictions,
        dropped_tokens=m.dropped_tokens,
        fragmentation=cache.fragmentation(),
        ops=[op_stat(op, times[op]) for op in OPS],
        seconds=seconds,
    )
    log.info("trace %s: %d requests in %.1f s", policy.value, len(trace), seconds)
    return TraceResult(row, cache)


def _serve(
    cache: CacheController, req: Request, times: dict[str, list[float]], gen: torch.Generator | None
) -> None:
    """One request: match, lock, load back, allocate the new tokens, insert prompt + answer, unlock."""
    clock = time.perf_counter
    t0 = clock()
    m = cache.match(req.prompt)
    t1 = clock()
    lease = cache.acquire(m)
    t2 = clock()
    h = cache.load_back(m)
    t3 = clock()
    times["match"].append(t1 - t0)
    times["acquire"].append(t2 - t1)
    if m.host_nodes:  # an empty load back is a no-op; time the real submissions only
        times["load_back"].append(t3 - t2)
    for layer in range(cache.spec.num_layers):  # the model reads layer i once it has landed
        h.wait_layer(layer)

    cached = m.device_slots if h.recompute else torch.cat([m.device_slots, h.device_slots])
    tokens = req.prompt + req.answer
    t0 = clock()
    new = cache.alloc_device(len(tokens) - len(cached))
    times["alloc_device"].append(clock() - t0)
    if gen is not None:
        write_random_kv(cache.device_pool, new, gen)
    slots = torch.cat([cached, new])
    t0 = clock()
    cache.insert(tokens, slots)
    t1 = clock()
    cache.release(lease)
    times["insert"].append(t1 - t0)
    times["release"].append(clock() - t1)


def render(rows: list[TraceRow], meta: dict) -> Group:
    """The two tables of the trace: per write policy, what the cache did, and the host time of each call."""
    t = meta["trace"]
    where = meta.get("gpu") or meta.get("cpu")
    table = Table(
        title=f"multi-turn trace: {meta['spec']} x {meta['layers']} layers "
        f"({meta['bytes_per_token']} B/token), "
        f"page {meta['page_size']}, {t['device_slots']} device / {t['host_slots']} host slots, "
        f"{t['conversations']} conversations x {t['turns']} turns ({rows[0].requests} requests), "
        f"on {where}"
    )
    table.add_column("policy", no_wrap=True)
    cols = ("device hit", "host hit", "miss", "H2D MB", "D2H MB", "backups", "evictions dev/host")
    cols += ("evicted tok", "dropped tok", "free runs host/dev", "s")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        f = r.fragmentation
        table.add_row(
            r.policy,
            f"{r.device_hit:.3f}",
            f"{r.host_hit:.3f}",
            f"{r.miss:.3f}",
            f"{r.bytes_h2d / 1e6:.1f}",
            f"{r.bytes_d2h / 1e6:.1f}",
            str(r.backups),
            f"{r.device_evictions}/{r.host_evictions}",
            str(r.device_evicted_tokens),
            str(r.dropped_tokens),
            f"{f['host_free_runs']}/{f['device_free_runs']}",
            f"{r.seconds:.1f}",
        )
    ops = Table(title="host time per controller call, microseconds: median / p99 (calls)")
    ops.add_column("op")
    for r in rows:
        ops.add_column(r.policy, justify="right")
    for i, op in enumerate(OPS):
        cells = [f"{s.median_us:.0f} / {s.p99_us:.0f} ({s.calls})" for s in (r.ops[i] for r in rows)]
        ops.add_row(op + (" (submit)" if op == "load_back" else ""), *cells)
    return Group(table, ops)


def metadata(cfg: TraceConfig, policies: list[str], **extra) -> dict:
    """What a JSON report needs besides the rows: when, where, which spec, sizes and policies."""
    return {
        **environment(cfg.device),
        "spec": cfg.spec.name,
        "layers": cfg.spec.num_layers,
        "page_size": cfg.spec.page_size,
        "bytes_per_token": cfg.spec.bytes_per_token(),
        "policies": list(policies),
        "trace": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("spec", "device")},
        **extra,
    }
