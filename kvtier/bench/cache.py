"""`kvtier bench cache`: the tiered prefix cache driven the way a serving engine drives it.

Three measurements:

- `run_trace`: a synthetic multi-turn chat trace under device-memory pressure. A few
  system prompts and long documents are shared by many conversations; turn t's
  prompt is turn t-1's prompt and answer plus a new user message. The device pool
  holds only a few conversations, so earlier turns are evicted to the host and
  loaded back. Per write policy: hit ratios per tier, bytes moved each way,
  evictions, fragmentation, and the host (CPU) cost of each controller call.
- `run_allocator`: `HostSlotAllocator` over a 4M-slot pool after heavy churn at ~90%
  occupancy; the time of one `alloc(n)` + `free` pair for a few sizes.
- `run_prefix_reload`: a 128k-token prefix evicted to the host; the CPU time of
  `match` + `load_back` submission, and on CUDA the time until the last layer has
  landed against the ceiling of one contiguous pinned copy measured in the same run.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from kvtier.alloc import AllocPolicy, HostSlotAllocator
from kvtier.bench.common import ceiling_gbps, environment
from kvtier.cache import CacheConfig, CacheController, WritePolicy
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)

OPS = ("match", "acquire", "load_back", "alloc_device", "insert", "release")
ALLOC_TARGET_US = 200.0
RELOAD_CPU_TARGET_US = 1000.0
RELOAD_RATIO_TARGET = 1.1
VOCAB = 128_000

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# -- 1. the multi-turn trace ---------------------------------------------------------------


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
class OpStat:
    """Host time of one controller call over a run, in microseconds."""

    op: str
    calls: int
    median_us: float
    p99_us: float
    max_us: float


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


def build_pools(cfg: TraceConfig) -> tuple[DevicePool, HostPool]:
    """Pools for the trace; a controller per policy can reuse them (it owns only the slot maps)."""
    dev = DevicePool(cfg.spec, cfg.device_slots, cfg.device)
    host = HostPool(cfg.spec, cfg.host_slots)
    return dev, host


def run_trace(
    cfg: TraceConfig,
    policy: WritePolicy | str,
    pools: tuple[DevicePool, HostPool] | None = None,
    progress: Progress = _quiet,
) -> TraceResult:
    """Serve the whole trace through a fresh controller with `policy`; one row of results."""
    policy = WritePolicy(policy)
    trace = make_trace(cfg)
    longest = max(len(r.prompt) + len(r.answer) for r in trace)
    if longest > cfg.device_slots:
        raise ValueError(
            f"the longest request ({longest} tokens) does not fit {cfg.device_slots} device slots"
        )
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
    assert hits == prompt_tokens, (hits, prompt_tokens)
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
        ops=[_stat(op, times[op]) for op in OPS],
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
        _write_kv(cache.device_pool, new, gen)
    slots = torch.cat([cached, new])
    t0 = clock()
    cache.insert(tokens, slots)
    t1 = clock()
    cache.release(lease)
    times["insert"].append(t1 - t0)
    times["release"].append(clock() - t1)


def _write_kv(pool: DevicePool, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes in every buffer and layer of `slots`, as a forward pass would write."""
    if not len(slots):
        return
    idx = slots.to(pool.device)
    for b in pool.spec.buffers:
        for layer in b.layers:
            raw = torch.randint(
                0, 256, (len(slots), b.row_bytes), dtype=torch.uint8, device=pool.device, generator=gen
            )
            pool.layer(b.name, layer)[idx] = raw.view(b.dtype).view(len(slots), *b.row_shape)


def _stat(op: str, seconds: Sequence[float]) -> OpStat:
    if not seconds:
        return OpStat(op, 0, 0.0, 0.0, 0.0)
    us = np.asarray(seconds) * 1e6
    return OpStat(
        op,
        len(us),
        round(float(np.median(us)), 2),
        round(float(np.percentile(us, 99)), 2),
        round(float(us.max()), 2),
    )


# -- 2. the allocator at scale -------------------------------------------------------------


@dataclass
class AllocRow:
    policy: str
    pool_slots: int
    page_size: int
    churn_ops: int
    occupancy: float  # share of slots allocated when timing
    free_runs: int
    prefix_runs: int | None  # runs of one `prefix`-slot allocation after the churn (None: no room)
    n: int
    pairs: int
    median_us: float
    p99_us: float
    target_us: float
    met: bool


def run_allocator(
    pool_slots: int = 4 * 1024 * 1024,
    page_size: int = 1,
    churn_ops: int = 60_000,
    pairs: int = 2000,
    sizes: Sequence[int] = (64, 1024, 16384),
    policies: Sequence[AllocPolicy | str] = (AllocPolicy.CONTIGUOUS, AllocPolicy.FIRST_FIT),
    max_alloc: int = 4096,
    fill: float = 0.9,
    seed: int = 0,
    progress: Progress = _quiet,
    prefix: int = 131072,
) -> list[AllocRow]:
    """Per policy: churn the allocator at ~`fill` occupancy, then time `alloc(n)` + `free` pairs.

    Also counts the runs that one `prefix`-slot allocation gets after the churn (then freed):
    how many host runs a long prefix backed up then would load from.
    """
    rows = []
    for policy in policies:
        policy = AllocPolicy(policy)
        progress(f"allocator {policy.value}: {churn_ops} churn operations")
        alloc = HostSlotAllocator(pool_slots, page_size, policy)
        live = _churn(alloc, churn_ops, max_alloc, fill, random.Random(seed))
        occupancy = 1 - alloc.available() / pool_slots
        runs = alloc.free_runs()
        got = alloc.alloc_runs(prefix) if prefix <= alloc.available() else None
        prefix_runs = None if got is None else len(got[1])
        if got is not None:
            alloc.free(got[0])
        for n in sizes:
            n = max(page_size, -(-n // page_size) * page_size)
            if n > alloc.available():
                log.warning(
                    "allocator %s: only %d slots free, skipping n=%d", policy.value, alloc.available(), n
                )
                continue
            samples = []
            for _ in range(pairs):
                t0 = time.perf_counter()
                slots = alloc.alloc(n)
                alloc.free(slots)
                samples.append(time.perf_counter() - t0)
            s = _stat("alloc+free", samples)
            rows.append(
                AllocRow(
                    policy=policy.value,
                    pool_slots=pool_slots,
                    page_size=page_size,
                    churn_ops=churn_ops,
                    occupancy=round(occupancy, 4),
                    free_runs=runs,
                    prefix_runs=prefix_runs,
                    n=n,
                    pairs=pairs,
                    median_us=s.median_us,
                    p99_us=s.p99_us,
                    target_us=ALLOC_TARGET_US,
                    met=s.p99_us <= ALLOC_TARGET_US,
                )
            )
        del live
    return rows


def _churn(
    alloc: HostSlotAllocator, ops: int, max_alloc: int, fill: float, rng: random.Random
) -> list[torch.Tensor]:
    """Random allocations of 1..`max_alloc` slots and frees of random live ones, around `fill` occupancy."""
    ps = alloc.page_size
    live: list[torch.Tensor] = []
    target = fill * alloc.num_slots

    def alloc_one() -> bool:
        n = max(ps, -(-rng.randint(1, max_alloc) // ps) * ps)
        slots = alloc.alloc(n)
        if slots is not None:
            live.append(slots)
        return slots is not None

    while alloc.num_slots - alloc.available() < target and alloc_one():
        pass
    for _ in range(ops):
        # Above the target free, below it allocate: occupancy stays within one allocation of it.
        if live and alloc.num_slots - alloc.available() >= target:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            alloc.free(live.pop())
        else:
            alloc_one()
    return live


# -- 3. a 128k-token prefix reloaded -------------------------------------------------------


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
    layers_per_load: int  # layers a kernel reload moves per launch (CacheConfig.layers_per_load)
    cpu_us: float  # median process time (all threads) of match + load_back submission
    thread_us: float  # median CPU time of the calling thread alone, same calls
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
    samples: list[dict[str, float]] = field(default_factory=list)


def run_prefix_reload(
    spec: KVSpec,
    tokens: int = 131072,
    device: torch.device | str = "cpu",
    repeats: int = 5,
    policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
    seed: int = 0,
    progress: Progress = _quiet,
    query_ids: str = "int32",
    host_runs: int = 1,
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST,
    layers_per_load: int = 1,
) -> ReloadRow:
    """Insert a `tokens`-long sequence, evict it to the host, then time match + load_back `repeats` times.

    `query_ids`: the dtype of the ids given to `match` (`int32` or `int64`). `host_runs`:
    the host copy of the prefix lies in this many runs (the host pool is fragmented
    before the write-through backup, as after churn), so every layer loads in as many
    copies. `host_layout`: the host pool's layout; `layers_per_load`: layers a reload
    through the kernel moves per launch (in `page_first`, as layer groups).
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    ps = spec.page_size
    if tokens <= 0 or host_runs < 1 or tokens % (ps * host_runs):
        raise ValueError(
            f"tokens {tokens} must be a positive multiple of the page size {ps} times host_runs {host_runs}"
        )
    layout = HostLayout(host_layout)
    if isinstance(layers_per_load, bool) or not isinstance(layers_per_load, int) or layers_per_load < 1:
        raise ValueError(f"layers_per_load must be a positive int, got {layers_per_load!r}")
    progress(f"reload: pools of {tokens} slots ({tokens * spec.bytes_per_token() / 1e9:.2f} GB per tier)")
    cache = CacheController(
        DevicePool(spec, tokens, device),
        HostPool(spec, tokens + (host_runs - 1) * ps, layout),
        CacheConfig(write_policy=WritePolicy(policy), layers_per_load=layers_per_load),
    )
    _fragment(cache.host_alloc, tokens // host_runs, host_runs, ps)
    rng = np.random.default_rng(seed)
    # The ids as an engine holds them, in one dtype for insert and match.
    ids = rng.integers(1, VOCAB, tokens).astype(query_ids)
    slots = cache.alloc_device(tokens)
    _write_kv(cache.device_pool, slots, torch.Generator(device=device).manual_seed(seed))
    node = cache.insert(ids, slots)
    cache.flush()  # the write-through backup, which would share the link with the ceiling's copies
    ceiling = ceiling_gbps(device, tokens * spec.layer_bytes_per_token(0)) if cuda else None

    samples = []
    loaded_bytes = 0
    for r in range(repeats):
        progress(f"reload: repeat {r + 1}/{repeats}")
        # A new request's ids, as an engine holds them when it calls match (made before the
        # timed calls: building them from Python ints is the tokenizer's cost, not the cache's).
        query = ids.copy()
        cache.flush()  # the write-through backup (or the last reload) completes
        cache.evict_device(tokens)
        if node.host_runs is None or len(node.host_runs) != host_runs:
            raise AssertionError(f"the prefix's host copy is in {node.host_runs} runs, not {host_runs}")
        before = cache.metrics.bytes_h2d
        if cuda:
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
        if cuda:
            first, last = _poll_layers(h)
            sample["first_layer_ms"] = (first - w1) * 1e3
            sample["reload_ms"] = (last - w1) * 1e3
        h.wait()
        if h.tokens != tokens:
            raise AssertionError(f"reload moved {h.tokens} tokens, expected {tokens} (host copy missing?)")
        loaded_bytes = cache.metrics.bytes_h2d - before
        samples.append({k: round(v, 3) for k, v in sample.items()})
    cache.flush()

    def med(key: str) -> float:
        return round(statistics.median(s[key] for s in samples), 3)

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
        layers_per_load=layers_per_load,
        cpu_us=med("cpu_us"),
        thread_us=med("thread_us"),
        wall_us=med("wall_us"),
        match_us=med("match_us"),
        target_cpu_us=RELOAD_CPU_TARGET_US,
        cpu_met=med("cpu_us") <= RELOAD_CPU_TARGET_US,
        samples=samples,
    )
    if cuda:
        row.reload_ms = med("reload_ms")
        row.first_layer_ms = med("first_layer_ms")
        row.ceiling_gbps = round(ceiling, 2)
        row.ideal_ms = round(loaded_bytes / (ceiling * 1e9) * 1e3, 3)
        row.ratio = round(row.reload_ms / row.ideal_ms, 3)
        row.ratio_met = row.ratio <= RELOAD_RATIO_TARGET
    return row


def _fragment(host_alloc, piece: int, runs: int, gap: int) -> None:
    """Leave the free host slots as `runs` runs of `piece` slots, one `gap` held between each two."""
    pieces = []
    for i in range(runs):
        pieces.append(host_alloc.alloc(piece))
        if i < runs - 1:
            host_alloc.alloc(gap)  # held for the rest of the bench
    for p in pieces:
        host_alloc.free(p)


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


# -- metadata ------------------------------------------------------------------------------


def metadata(cfg: TraceConfig, policies: Sequence[str], **extra) -> dict:
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
