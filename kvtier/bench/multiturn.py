"""`kvtier bench multiturn`: many conversations over one engine, three caches, repeated, in any order.

The shape of SGLang's `benchmark/hicache/bench_multiturn.py`, in process (no HTTP in the
timed path). What runs is a `Plan` (`kvtier.bench.multiturn_plan`: synthetic conversations,
closed loop or at a Poisson rate, or a replayed trace, `kvtier.bench.multiturn_trace`).
The numbers are `kvtier.bench.multiturn_stats`'s.

Configurations: `kvtier` (device and host tiers), `device-only` (nothing is ever backed up,
and the host pool is one page: a server without a hierarchical cache) and `no-cache` (no
prefix cache). `run` runs each table (a plan: one per answer length, or the trace) `repeats`
times; each repeat runs every configuration once, in the order `Order` gives that repeat.

One run of a configuration (`run_config`), the same for every configuration and position:
build its engine (the model is built once, before any); warm it (`warm_up`: one prompt as long
as the plan's longest, evicted from the device and asked again, then as many short requests at
once as the plan has conversations, up to `max_num_seqs`), so no timed step compiles a kernel
for a long prompt, a long decode or a move between tiers (whichever configuration ran first
paid for those) or captures the first graph of a batch size; settle the cache's transfers and
evict the warm-up's pages from both tiers (the timed run starts from an empty cache); collect
and freeze the garbage collector's heap (a collection over the model's objects never lands in
a timed step); run the plan, timing each engine step (`machine.steps`: the longest, with what
each did, show where a stall was) and the process's CPU seconds and the load average (a machine
busy with other work shows there); then close the engine and collect, so nothing of it is
alive when the next is built.

The driver runs the engine in the calling thread: submit what has arrived, `step()`, route
the updates, repeat; with nothing running and nothing due it sleeps until the next arrival.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from kvtier.bench.common import close, collect, environment, quiet
from kvtier.bench.engines import context_of, drain, step, vocab_size
from kvtier.bench.multiturn_plan import Plan, Turn
from kvtier.bench.multiturn_stats import (
    STEP_COUNTERS,
    RequestRecord,
    StepLog,
    aggregate,
    summarize,
    token_gaps,
)
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
WARMUP = SamplingParams(max_tokens=4, ignore_eos=True)
WARMUP_TOKENS = 32


class Order(str, Enum):
    """How the configurations' order changes from repeat to repeat (`config_orders`)."""

    FIXED = "fixed"  # as given, every repeat
    ALTERNATE = "alternate"  # as given, then reversed, in turn
    ROTATE = "rotate"  # repeat r starts at the r-th configuration given
    SHUFFLE = "shuffle"  # a random order per repeat, from the seed


def config_orders(
    configs: tuple[str, ...], repeats: int, order: Order, seed: int = 0
) -> list[tuple[str, ...]]:
    """Each repeat's order of `configs`; `ConfigError` for an empty or repeated configuration."""
    if not configs or len(set(configs)) != len(configs) or repeats < 1:
        raise ConfigError(
            f"configurations must be distinct and at least one, repeats >= 1: {configs}, {repeats}"
        )
    order = Order(order)
    rng = np.random.default_rng(seed + 3)
    out = []
    for r in range(repeats):
        if order is Order.ALTERNATE:
            out.append(configs if r % 2 == 0 else configs[::-1])
        elif order is Order.ROTATE:
            k = r % len(configs)
            out.append(configs[k:] + configs[:k])
        elif order is Order.SHUFFLE:
            out.append(tuple(configs[i] for i in rng.permutation(len(configs))))
        else:
            out.append(configs)
    return out


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
    """The driver's state of one conversation: what it said so far and its next turn."""

    client: int
    turns: tuple[Turn, ...]
    tokens: list[list[int]]
    history: list[int] = field(default_factory=list)
    round: int = 0  # the turn it sends next
    ready_s: float = 0.0  # when its previous turn finished

    @property
    def next_arrival_s(self) -> float | None:
        return self.turns[self.round].arrival_s

    def prompt(self) -> list[int]:
        return self.history + self.tokens[self.round]


def drive(
    eng: Engine, plan: Plan, vocab: int, progress: Callable[[str], None] = quiet, label: str = ""
) -> tuple[list[RequestRecord], float, StepLog]:
    """Run every turn of `plan` on `eng`: `(a record per request, seconds to the last, its steps)`."""
    arrivals = plan.arrivals()
    ready = [
        _Conversation(c, turns, toks)
        for c, (turns, toks) in enumerate(zip(plan.conversations, plan.tokens(vocab), strict=True))
    ]
    inflight: dict[int, tuple[_Conversation, list[int], float, float]] = {}
    records: list[RequestRecord] = []
    total, steps = plan.total_turns, StepLog()
    t0 = time.perf_counter()
    while len(records) < total:
        now = time.perf_counter() - t0
        due = arrivals.due(ready, now)
        for i, at in due:
            conv = ready[i]
            prompt = conv.prompt()
            req = eng.submit(prompt, conv.turns[conv.round].params())
            inflight[req.id] = (conv, prompt, max(at, conv.ready_s), now)
        taken = {i for i, _ in due}
        ready = [c for i, c in enumerate(ready) if i not in taken]
        if not eng.busy:
            wake = arrivals.wake_at(ready)
            if wake is None:
                raise InvariantError(
                    f"engine idle with {len(records)} of {total} requests done and none ready to send"
                )
            time.sleep(max(0.0, wake - (time.perf_counter() - t0)))
            continue
        counters = [getattr(eng.cache.metrics, k) for k in STEP_COUNTERS]
        preempted = eng.stats.preemptions
        began = time.perf_counter()
        updates = step(eng)
        ended = time.perf_counter()
        steps.add(began - t0, ended - began, lambda u=updates, c=counters, p=preempted: _did(eng, u, c, p))
        for update in updates:
            if update.result is None:
                continue
            conv, prompt, arrived, sent = inflight.pop(update.request.id)
            records.append(_record(conv, arrived, sent, update.result, t0))
            conv.history = prompt + list(update.result.tokens)
            conv.ready_s = update.result.token_times[-1] - t0
            conv.round += 1
            if conv.round < len(conv.turns):
                ready.append(conv)
            if len(records) % max(1, total // 10) == 0:
                progress(f"{label}: {len(records)}/{total} requests, {time.perf_counter() - t0:.1f} s")
    return records, time.perf_counter() - t0, steps


def _record(conv: _Conversation, arrived: float, sent: float, r, t0: float) -> RequestRecord:
    """A finished request's record; latencies from its arrival (`t0 + arrived`)."""
    start = t0 + arrived
    return RequestRecord(
        client=conv.client,
        round=conv.round + 1,
        arrived_s=round(arrived, 6),
        submitted_s=round(sent, 6),
        prompt_tokens=r.prompt_tokens,
        output_tokens=len(r.tokens),
        ttft_s=round(r.token_times[0] - start, 6),
        total_s=round(r.token_times[-1] - start, 6),
        device_hit_tokens=r.device_hit_tokens,
        host_hit_tokens=r.host_hit_tokens,
        storage_hit_tokens=r.storage_hit_tokens,
        preemptions=r.preemptions,
        finish_reason=r.finish_reason,
        token_gaps_s=token_gaps(r.token_times),
    )


def _did(eng: Engine, updates: list, counters: list[int], preempted: int) -> dict:
    """What the step just run did (`StepLog`): `counters` and `preempted` as they were before it."""
    grown = {k: getattr(eng.cache.metrics, k) - c for k, c in zip(STEP_COUNTERS, counters, strict=True)}
    return {
        "tokens": sum(u.token is not None for u in updates),
        "running": eng.num_running,
        "waiting": eng.num_waiting,
        "preemptions": eng.stats.preemptions - preempted,
        **grown,
    }


def warm_up(eng: Engine, plan: Plan, vocab: int, seed: int) -> None:
    """One prompt as long as the plan's longest request (prefill pieces over a context, decodes over
    the widest table), evicted from the device and asked again with one token more (a host hit where
    the configuration backs up; a miss elsewhere); then short requests at once, as many as the
    plan's conversations (up to `max_num_seqs`); then an empty cache: their transfers settled and
    their pages evicted from both tiers."""
    rng = np.random.default_rng(seed + 2)
    long = rng.integers(0, vocab, max(plan.longest_tokens - WARMUP.max_tokens - 1, 1)).tolist()
    for prompt in (long, [*long, 0]):
        eng.submit(prompt, WARMUP)
        drain(eng)
        eng.settle()
        eng.cache.evict_device(eng.device_pool.num_slots)
    n = min(len(plan.conversations), eng.scheduler.max_num_seqs)
    for _ in range(n):
        eng.submit(rng.integers(0, vocab, WARMUP_TOKENS).tolist(), WARMUP)
    drain(eng)
    eng.settle()
    eng.cache.evict_device(eng.device_pool.num_slots)
    eng.settle()
    eng.cache.evict_host(eng.host_pool.num_slots)
    eng.settle()


def run_config(
    config: str, model, tokenizer, setup: EngineSetup, plan: Plan, progress: Callable[[str], None]
) -> dict:
    """One configuration's run (see the module docstring); its summary."""
    vocab = vocab_size(model)
    eng = build_engine(config, model, tokenizer, setup)
    try:
        warm_up(eng, plan, vocab, plan.seed)
        before = dataclasses.replace(eng.cache.metrics)
        preempted = eng.stats.preemptions
        gc.collect()
        gc.freeze()
        load, cpu = os.getloadavg()[0], time.process_time()
        records, duration, steps = drive(eng, plan, vocab, progress, config)
        machine = {
            "cpu_s": round(time.process_time() - cpu, 3),
            "threads": torch.get_num_threads() if eng.device.type == "cpu" else None,  # the CPU's compute
            "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "longest_step_s": steps.longest_s,
            "steps": steps.summary(),
        }
        cache = {k: getattr(eng.cache.metrics, k) - getattr(before, k) for k in CACHE_COUNTERS}
        preemptions = eng.stats.preemptions - preempted
        log.info("%s: %d requests in %.2f s, %d preemptions", config, len(records), duration, preemptions)
    finally:
        gc.unfreeze()
        close(eng)
    return summarize(config, records, duration, preemptions, cache, machine)


def run(
    model,
    tokenizer,
    configs: tuple[str, ...],
    setup: EngineSetup,
    tables: list[dict],
    plans: list[Plan],
    repeats: int = 1,
    order: Order = Order.ROTATE,
    progress: Callable[[str], None] = quiet,
    on_run: Callable[[list[dict]], None] = lambda _tables: None,
    warm_run: bool = True,
) -> list[dict]:
    """Each plan's table: `repeats` repeats of every configuration, one engine alive at a time.

    `tables`: one dict per plan (its label and sizes), filled in place with `runs` (each repeat's
    order and summaries) and `aggregate`'s spreads and ratios; `on_run` gets them after each
    configuration's run (a run cut short keeps what finished). Every plan is checked first.
    `warm_run`: before a table's timed runs, one untimed run of its plan (`kvtier`'s, whose moves
    between tiers need kernels the others do not): Triton compiles a kernel's variant the first
    time the process meets its sizes and alignments, 0.7-1.8 s each on an H100, and without it
    those stalls land on whichever configuration runs first. Its wall time is in `warm_run_s`.
    """
    orders = config_orders(configs, repeats, order, plans[0].seed if plans else 0)
    for plan in plans:
        check_fits(model, setup, plan)
    for table in tables:
        table["runs"] = []
    for table, plan in zip(tables, plans, strict=True):
        if warm_run:
            first = "kvtier" if "kvtier" in configs else configs[0]
            progress(f"{table['label']}: an untimed {first} run (kernels compile on first use)")
            table["warm_run_s"] = run_config(first, model, tokenizer, setup, plan, progress)["duration_s"]
            collect()
        for r, this in enumerate(orders):
            run_: dict = {"repeat": r + 1, "order": list(this), "configs": []}
            table["runs"].append(run_)
            for config in this:
                progress(f"{table['label']}, repeat {r + 1}/{repeats}: {config}")
                run_["configs"].append(run_config(config, model, tokenizer, setup, plan, progress))
                collect()  # the engine run_config closed is unreachable now
                table.update(aggregate(table["runs"]))
                on_run(tables)
    return tables


def check_fits(model, setup: EngineSetup, plan: Plan) -> None:
    """`ConfigError` unless every conversation's last request fits the model's context and the device pool."""
    need, context = plan.longest_tokens, context_of(model)
    if context and need > context:
        raise ConfigError(f"a conversation grows to {need} tokens; the model's context is {context}")
    if need > setup.device_tokens:
        raise ConfigError(
            f"a conversation's last request needs {need} device slots; the device pool has "
            f"{setup.device_tokens}"
        )


def table_of(label: str, plan: Plan, setup: EngineSetup, per_token: int) -> dict:
    """A table's label and sizes: conversations, requests, working set against the device budget."""
    ws = plan.working_set_tokens
    outputs = sorted({t.output_tokens for conv in plan.conversations for t in conv})
    return {
        "label": label,
        "conversations": len(plan.conversations),
        "requests": plan.total_turns,
        "output_tokens": outputs[0] if len(outputs) == 1 else outputs,
        "longest_conversation_tokens": plan.longest_tokens,
        "working_set_tokens": ws,
        "working_set_bytes": ws * per_token,
        "working_set_over_device": round(ws / setup.device_tokens, 2),
    }


def meta_of(model, name: str, setup: EngineSetup, workload: dict, device: torch.device) -> dict:
    """What the run was: machine, model, pools, and `workload` (the flags that made the plans)."""
    dtype = next(model.parameters()).dtype
    per_token = spec_from_hf_config(model.config, dtype=dtype).bytes_per_token()
    return {
        **environment(device),
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_bytes_per_token": per_token,
        **dataclasses.asdict(setup),
        "device_kv_bytes": setup.device_tokens * per_token,
        "workload": workload,
    }
