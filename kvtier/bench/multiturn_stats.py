"""`kvtier bench multiturn`'s numbers: a record per request, a summary per run, the spread over repeats.

A request's latencies count from its arrival (`arrived_s`: when its turn was due and its
conversation ready; the driver submits it at the next step boundary), so a request that
waits behind a running step waits on the clock. TTFT: arrival to first token. ITL
(inter-token latency): the gaps between a request's successive tokens (`[t1 - t0, t2 - t1,
...]` of its token times; none for a one-token answer), pooled over requests for the
percentiles. Percentiles interpolate linearly between samples; a figure with no sample is
None.

Warm and cold: a conversation's first turn is cold (no configuration can reuse anything
for it); its later turns are warm (its previous prompt and answer can be reused). The
headline compares warm turns; cold ones are reported apart.

`summarize` makes a run's JSON summary (a plain dict). `aggregate` gives, over the repeats
of a table, each `FIGURES` entry's spread per configuration (min, median, max) and the
kvtier / device-only ratios paired by repeat (each ratio from one repeat, then its spread).
`agreement` compares the spreads of two reports (the same comparison run in two orders).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import numpy as np

TIERS = ("device", "host", "storage", "miss")
QUANTILES = (50, 90, 99)


def _at(*path: str) -> Callable[[dict], float | None]:
    """A getter of the number at `path` in a run's summary (None where it lacks one)."""

    def get(summary: dict) -> float | None:
        value: object = summary
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    return get


def _cpu_share(summary: dict) -> float | None:
    """On the CPU device, the process's CPU seconds over what its torch threads could have used in the
    run's wall time: well below 1, the machine's other work had the cores (and the wall-clock figures
    measure that work too)."""
    m = summary.get("machine") or {}
    if "cpu_s" not in m or not m.get("threads") or not summary.get("duration_s"):
        return None
    return round(m["cpu_s"] / (summary["duration_s"] * m["threads"]), 3)


# What a step log notes of each of its longest steps: the cache's counters' growth in the step.
STEP_COUNTERS = ("miss_tokens", "loaded_tokens", "device_evicted_tokens", "bytes_h2d", "bytes_d2h")


@dataclass
class StepLog:
    """The timed steps of a run: how many, their total and longest wall times, and the `keep`
    longest with what each did (tokens made, requests running and waiting after it, preemptions
    and `STEP_COUNTERS` in it): where a stall shows, what the step was doing."""

    keep: int = 8
    count: int = 0
    total_s: float = 0.0
    over_100ms: int = 0
    longest: list[dict] = field(default_factory=list)

    def add(self, at_s: float, wall_s: float, what: Callable[[], dict]) -> None:
        """One step that began `at_s` into the run and took `wall_s`; `what()` (called only for a
        step among the longest so far) describes it."""
        self.count += 1
        self.total_s += wall_s
        self.over_100ms += wall_s > 0.1
        if len(self.longest) < self.keep or wall_s > self.longest[-1]["wall_s"]:
            self.longest.append({"at_s": round(at_s, 4), "wall_s": round(wall_s, 4), **what()})
            self.longest.sort(key=lambda s: -s["wall_s"])
            del self.longest[self.keep :]

    @property
    def longest_s(self) -> float:
        return self.longest[0]["wall_s"] if self.longest else 0.0

    def summary(self) -> dict:
        return {
            "count": self.count,
            "total_s": round(self.total_s, 4),
            "over_100ms": self.over_100ms,
            "longest": self.longest,
        }


# The headline figures: name -> its getter from a run's summary.
FIGURES: dict[str, Callable[[dict], float | None]] = {
    "requests_per_s": _at("requests_per_s"),
    "output_tokens_per_s": _at("output_tokens_per_s"),
    "input_tokens_per_s": _at("input_tokens_per_s"),
    **{f"warm_ttft_p{q}_s": _at("warm", f"ttft_p{q}_s") for q in QUANTILES},
    "cold_ttft_p50_s": _at("cold", "ttft_p50_s"),
    **{f"itl_p{q}_s": _at(f"itl_p{q}_s") for q in QUANTILES},
    "longest_step_s": _at("machine", "longest_step_s"),
    "cpu_s": _at("machine", "cpu_s"),
    "cpu_share": _cpu_share,
}
# kvtier / device-only, per repeat: name -> figure.
RATIOS = {
    "warm_ttft_p50_kvtier_over_device_only": "warm_ttft_p50_s",
    "cold_ttft_p50_kvtier_over_device_only": "cold_ttft_p50_s",
    "throughput_kvtier_over_device_only": "requests_per_s",
    "output_tokens_per_s_kvtier_over_device_only": "output_tokens_per_s",
    "cpu_s_kvtier_over_device_only": "cpu_s",
}


@dataclass(frozen=True)
class RequestRecord:
    """One request as it ran (`round` from 1; seconds from the run's start, or from its arrival)."""

    client: int
    round: int
    arrived_s: float
    submitted_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    total_s: float
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    preemptions: int
    finish_reason: str
    token_gaps_s: tuple[float, ...] = field(default=())

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        """A record as a report stored it (one written before arrivals and gaps: from submission, no gaps)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        values.setdefault("arrived_s", d["submitted_s"])
        values["token_gaps_s"] = tuple(values.get("token_gaps_s", ()))
        return cls(**values)

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.device_hit_tokens - self.host_hit_tokens - self.storage_hit_tokens

    @property
    def warm(self) -> bool:
        return self.round > 1


def token_gaps(token_times: list[float]) -> tuple[float, ...]:
    """Seconds between successive tokens: `len(token_times) - 1` gaps."""
    return tuple(round(b - a, 6) for a, b in itertools.pairwise(token_times))


def percentiles(name: str, values: list[float]) -> dict[str, float | None]:
    """`{name}_p50_s`, `_p90_s`, `_p99_s` of `values` (None when empty)."""
    if not values:
        return {f"{name}_p{q}_s": None for q in QUANTILES}
    return {f"{name}_p{q}_s": round(float(np.percentile(values, q)), 6) for q in QUANTILES}


def latency(records: list[RequestRecord]) -> dict:
    """Requests, TTFT and ITL percentiles of `records`."""
    return {
        "requests": len(records),
        **percentiles("ttft", [r.ttft_s for r in records]),
        **percentiles("itl", [g for r in records for g in r.token_gaps_s]),
    }


def tier_tokens(records: list[RequestRecord]) -> dict[str, int]:
    """Prompt tokens of `records` by tier: `device_hit_tokens`, ..., `miss_tokens`."""
    return {
        "device_hit_tokens": sum(r.device_hit_tokens for r in records),
        "host_hit_tokens": sum(r.host_hit_tokens for r in records),
        "storage_hit_tokens": sum(r.storage_hit_tokens for r in records),
        "miss_tokens": sum(r.miss_tokens for r in records),
    }


def summarize(
    config: str, records: list[RequestRecord], duration_s: float, preemptions: int, cache: dict, machine: dict
) -> dict:
    """A run's JSON summary: throughput over its wall time (input tokens: every prompt token, cached or
    not), latencies overall, warm and cold, per round, prompt tokens by tier, and `machine` (the
    process's CPU seconds, load averages, longest engine step)."""
    inputs = sum(r.prompt_tokens for r in records)
    outputs = sum(r.output_tokens for r in records)
    per_round = []
    for k in range(1, max((r.round for r in records), default=0) + 1):
        these = [r for r in records if r.round == k]
        per_round.append({"round": k, **latency(these), **tier_tokens(these)})
    overall = latency(records)
    del overall["requests"]
    return {
        "config": config,
        "requests": len(records),
        "duration_s": round(duration_s, 4),
        "requests_per_s": round(len(records) / duration_s, 4),
        "input_tokens": inputs,
        "output_tokens": outputs,
        "input_tokens_per_s": round(inputs / duration_s, 2),
        "output_tokens_per_s": round(outputs / duration_s, 2),
        **overall,
        "latency_p50_s": round(float(np.percentile([r.total_s for r in records], 50)), 6),
        "warm": latency([r for r in records if r.warm]),
        "cold": latency([r for r in records if not r.warm]),
        **tier_tokens(records),
        "preemptions": preemptions,
        "per_round": per_round,
        "cache": cache,
        "machine": machine,
        "records": [asdict(r) for r in records],
    }


def figure(summary: dict, name: str) -> float | None:
    """One of `FIGURES` from a run's summary (None where the summary lacks it)."""
    return FIGURES[name](summary)


def spread(values: list[float | None]) -> dict | None:
    """`{min, median, max, n}` of the values that are not None (None if there are none)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": float(np.median(xs)), "max": max(xs), "n": len(xs)}


def aggregate(runs: list[dict]) -> dict:
    """Over a table's repeats (`runs`: `{"configs": [summary, ...]}` each): every figure's spread per
    configuration, and the kvtier / device-only ratios' spreads (each ratio within one repeat)."""
    names = list(dict.fromkeys(c["config"] for run in runs for c in run["configs"]))
    by_run = [{c["config"]: c for c in run["configs"]} for run in runs]
    out: dict = {"spread": {}, "ratios": {}}
    for name in names:
        out["spread"][name] = {f: spread([figure(b[name], f) for b in by_run if name in b]) for f in FIGURES}
    for ratio, f in RATIOS.items():
        values = []
        for b in by_run:
            if "kvtier" in b and "device-only" in b:
                kv, dev = figure(b["kvtier"], f), figure(b["device-only"], f)
                values.append(round(kv / dev, 4) if kv is not None and dev else None)
        s = spread(values)
        if s is not None:
            out["ratios"][ratio] = {**s, "values": values}
    return out


def agreement(aggregates: list[dict]) -> list[dict]:
    """Per configuration and figure, and per kvtier / device-only ratio, whether the reports' ranges
    (min..max over repeats) overlap (None where a report has a single repeat of it).

    `aggregates`: each report's `aggregate(...)` of the same table.
    """
    rows = []
    for config in aggregates[0]["spread"]:
        for f in FIGURES:
            rows.append(_overlap(config, f, [a["spread"].get(config, {}).get(f) for a in aggregates]))
    for ratio, f in RATIOS.items():
        rows.append(_overlap("kvtier / device-only", f, [a.get("ratios", {}).get(ratio) for a in aggregates]))
    return [r for r in rows if r is not None]


def _overlap(config: str, f: str, each: list[dict | None]) -> dict | None:
    if any(e is None for e in each):
        return None
    # One sample is no range: whether it would agree cannot be told.
    overlap = (
        max(e["min"] for e in each) <= min(e["max"] for e in each) if min(e["n"] for e in each) > 1 else None
    )
    return {"config": config, "figure": f, "spreads": each, "overlap": overlap}
