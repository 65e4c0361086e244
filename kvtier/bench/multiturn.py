"""`kvtier bench multiturn`: many clients in multi-turn conversations over one engine, three caches.

The shape of SGLang's `benchmark/hicache/bench_multiturn.py`, in process (no HTTP in the
timed path). `Workload`: `clients` conversations of `rounds` rounds; a conversation starts
with `context_tokens` random tokens, each round appends a question of `question_tokens`
random tokens to it (the previous prompt, then the answer the engine gave) and asks for
`output_tokens` tokens (`ignore_eos`, so every answer is exactly that long). The tokens
come from the seed alone, so every configuration runs the same conversations.

Arrivals: closed loop by default (each client sends its next round as soon as its
previous one finished); with `request_rate` R, rounds go at the instants of a Poisson
process of rate R, each to the client that has waited longest since its previous round
finished, and an instant at which no client is ready waits for the first that is (a
client's round never goes before its previous one finished).

The driver runs the engine in the calling thread: submit what has arrived, `step()`,
route the updates, repeat. TTFT is the engine's, from `submit`; throughput counts every
prompt token (cached or not) as input. Each configuration gets its own engine, warmed by
one short request outside the workload, run, closed and collected before the next:
`kvtier` (device and host tiers), `device-only` (nothing is ever backed up, and the host
pool is one page: a server without a hierarchical cache) and `no-cache` (no prefix cache).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.bench.common import close, collect, environment, quiet
from kvtier.bench.engines import context_of, run_alone, step, vocab_size
from kvtier.bench.multiturn_report import RequestRecord, summarize
from kvtier.cache import CacheConfig, WritePolicy
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.hf import spec_from_hf_config
from kvtier.errors import ConfigError, InvariantError

log = logging.getLogger(__name__)

CONFIGS = ("kvtier", "device-only", "no-cache")
# The cache metrics each configuration reports, as deltas over its timed run.
CACHE_COUNTERS = (
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "miss_tokens",
    "loaded_tokens",
    "recomputed_tokens",
    "device_evicted_tokens",
    "host_evicted_tokens",
    "bytes_h2d",
    "bytes_d2h",
)
WARMUP = SamplingParams(max_tokens=2, ignore_eos=True)
WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    """The conversations and how their rounds arrive (see the module docstring)."""

    clients: int
    rounds: int
    context_tokens: int = 0
    question_tokens: int = 128
    output_tokens: int = 16
    request_rate: float | None = None  # rounds per second; None: closed loop
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.clients, self.rounds, self.question_tokens, self.output_tokens) < 1:
            raise ConfigError(
                f"clients ({self.clients}), rounds ({self.rounds}), question_tokens ({self.question_tokens}) "
                f"and output_tokens ({self.output_tokens}) must be at least 1"
            )
        if self.context_tokens < 0 or (self.request_rate is not None and not self.request_rate > 0):
            raise ConfigError(
                f"context_tokens must be >= 0 and request_rate positive, got {self.context_tokens}, "
                f"{self.request_rate}"
            )

    @property
    def final_tokens(self) -> int:
        """A conversation's length after its last answer: also its last request's prompt plus output."""
        return self.context_tokens + self.rounds * (self.question_tokens + self.output_tokens)

    @property
    def working_set_tokens(self) -> int:
        return self.clients * self.final_tokens

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_tokens, temperature=0.0, ignore_eos=True)

    def questions(self, vocab: int) -> list[list[list[int]]]:
        """`[client][round]` token ids each round appends; round 0 starts with the context."""
        rng = np.random.default_rng(self.seed)
        out = []
        for _ in range(self.clients):
            context = rng.integers(0, vocab, self.context_tokens).tolist()
            qs = [rng.integers(0, vocab, self.question_tokens).tolist() for _ in range(self.rounds)]
            qs[0] = context + qs[0]
            out.append(qs)
        return out

    def arrivals(self) -> np.ndarray | None:
        """Seconds from the start of each Poisson instant (one per round), or None in a closed loop."""
        if self.request_rate is None:
            return None
        rng = np.random.default_rng(self.seed + 1)  # apart from the tokens: a rate changes no conversation
        return np.cumsum(rng.exponential(1 / self.request_rate, self.clients * self.rounds))


@dataclass(frozen=True)
class EngineSetup:
    """What every configuration's engine shares: the device budget and the scheduler's caps."""

    device_tokens: int
    host_tokens: int
    page_size: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


def build_engine(config: str, model, tokenizer, setup: EngineSetup) -> Engine:
    """The engine of one configuration (see the module docstring)."""
    page = setup.page_size or 1
    kw = dict(
        device_tokens=setup.device_tokens,
        page_size=setup.page_size,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
    )
    if config == "kvtier":
        return Engine(model, tokenizer, host_tokens=setup.host_tokens, config=CacheConfig(), **kw)
    if config == "device-only":
        never = CacheConfig(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, selective_hits=10**9)
        return Engine(model, tokenizer, host_tokens=page, config=never, **kw)
    if config == "no-cache":
        return Engine(model, tokenizer, host_tokens=page, prefix_cache=False, **kw)
    raise ConfigError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


@dataclass(eq=False)
class _Conversation:
    client: int
    questions: list[list[int]]
    history: list[int] = field(default_factory=list)
    round: int = 0  # the round it sends next

    def prompt(self) -> list[int]:
        return self.history + self.questions[self.round]


def drive(
    eng: Engine, workload: Workload, vocab: int, progress: Callable[[str], None] = quiet, label: str = ""
) -> tuple[list[RequestRecord], float]:
    """Run every round of the workload on `eng`; `(one record per request, seconds from start to last)`."""
    params = workload.params()
    ready = deque(_Conversation(c, qs) for c, qs in enumerate(workload.questions(vocab)))
    ticks = workload.arrivals()
    sent = 0
    inflight: dict[int, tuple[_Conversation, list[int], float]] = {}
    records: list[RequestRecord] = []
    total = workload.clients * workload.rounds
    t0 = time.perf_counter()
    while len(records) < total:
        now = time.perf_counter() - t0
        while ready and (ticks is None or ticks[sent] <= now):
            conv = ready.popleft()
            prompt = conv.prompt()
            req = eng.submit(prompt, params)
            inflight[req.id] = (conv, prompt, now)
            sent += 1
        if not eng.busy:
            if not ready or ticks is None:
                raise InvariantError(
                    f"engine idle with {len(records)} of {total} requests done and none ready to send"
                )
            time.sleep(max(0.0, ticks[sent] - (time.perf_counter() - t0)))
            continue
        for update in step(eng):
            if update.result is None:
                continue
            conv, prompt, at = inflight.pop(update.request.id)
            records.append(RequestRecord.of(conv.client, conv.round + 1, at, update.result))
            conv.history = prompt + list(update.result.tokens)
            conv.round += 1
            if conv.round < workload.rounds:
                ready.append(conv)
            if len(records) % max(1, total // 10) == 0:
                progress(f"{label}: {len(records)}/{total} requests, {time.perf_counter() - t0:.1f} s")
    return records, time.perf_counter() - t0


def run_config(
    config: str, model, tokenizer, setup: EngineSetup, workload: Workload, progress: Callable[[str], None]
) -> dict:
    """One configuration: build its engine, warm it, run the workload, close it; its summary."""
    vocab = vocab_size(model)
    eng = build_engine(config, model, tokenizer, setup)
    try:
        warm = np.random.default_rng(workload.seed + 2).integers(0, vocab, WARMUP_TOKENS).tolist()
        run_alone(eng, warm, WARMUP)
        before = dataclasses.replace(eng.cache.metrics)
        preempted = eng.stats.preemptions
        records, duration = drive(eng, workload, vocab, progress, config)
        cache = {k: getattr(eng.cache.metrics, k) - getattr(before, k) for k in CACHE_COUNTERS}
        preemptions = eng.stats.preemptions - preempted
        log.info("%s: %d requests in %.2f s, %d preemptions", config, len(records), duration, preemptions)
    finally:
        close(eng)
    return summarize(config, records, duration, workload.rounds, preemptions, cache)


def run(
    model,
    tokenizer,
    configs: tuple[str, ...],
    setup: EngineSetup,
    workload: Workload,
    progress: Callable[[str], None] = quiet,
    on_config: Callable[[list[dict]], None] = lambda _done: None,
) -> list[dict]:
    """Each configuration in turn over the same model and workload, one engine alive at a time.

    `on_config` gets the summaries so far after each configuration (a run cut short keeps them).
    """
    check_fits(model, setup, workload)
    out: list[dict] = []
    for config in configs:
        progress(f"{config}: {workload.clients} clients x {workload.rounds} rounds")
        out.append(run_config(config, model, tokenizer, setup, workload, progress))
        collect()  # the engine run_config closed is unreachable now
        on_config(out)
    return out


def check_fits(model, setup: EngineSetup, workload: Workload) -> None:
    """`ConfigError` unless a conversation's last request fits the model's context and the device pool."""
    need, context = workload.final_tokens, context_of(model)
    if context and need > context:
        raise ConfigError(f"a conversation grows to {need} tokens; the model's context is {context}")
    if need > setup.device_tokens:
        raise ConfigError(
            f"a conversation's last request needs {need} device slots; the device pool has "
            f"{setup.device_tokens}"
        )


def meta_of(model, name: str, setup: EngineSetup, workload: Workload, device: torch.device) -> dict:
    """What the run was: machine, model, workload, pools, and the working set against the device."""
    dtype = next(model.parameters()).dtype
    per_token = spec_from_hf_config(model.config, dtype=dtype).bytes_per_token()
    return {
        **environment(device),
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes_per_token": per_token,
        **dataclasses.asdict(setup),
        "workload": dataclasses.asdict(workload),
        "final_conversation_tokens": workload.final_tokens,
        "working_set_tokens": workload.working_set_tokens,
        "working_set_bytes": workload.working_set_tokens * per_token,
        "device_kv_bytes": setup.device_tokens * per_token,
        "working_set_over_device": round(workload.working_set_tokens / setup.device_tokens, 2),
    }


def ratios(configs: list[dict]) -> dict:
    """kvtier / device-only for TTFT p50 and throughput (requests/s), where both ran."""
    by = {c["config"]: c for c in configs}
    if "kvtier" not in by or "device-only" not in by:
        return {}
    kv, dev = by["kvtier"], by["device-only"]
    return {
        "ttft_p50_kvtier_over_device_only": _ratio(kv["ttft_p50_s"], dev["ttft_p50_s"]),
        "throughput_kvtier_over_device_only": _ratio(kv["requests_per_s"], dev["requests_per_s"]),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None
