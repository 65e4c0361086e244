"""`kvtier bench multiturn`'s numbers: one record per request, each configuration's summary, table, plot.

`summarize` turns a configuration's records into its JSON summary (a plain dict): throughput
over the run's wall time (input tokens are every prompt token, cached or not), TTFT
percentiles overall and per round (linear interpolation between samples), and prompt
tokens by where their KV came from (`miss_tokens`: computed by the request, the last
prompt token always among them). `render` is the table, `write_plot` the PNG
(matplotlib, imported only there, on the Agg backend).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from kvtier.engine import RequestResult

TIERS = ("device", "host", "storage", "miss")


@dataclass(frozen=True)
class RequestRecord:
    """One request of the workload as it ran (`round` from 1): seconds from the run's start and from its
    submit."""

    client: int
    round: int
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

    @classmethod
    def of(cls, client: int, round_: int, submitted_s: float, r: RequestResult) -> RequestRecord:
        return cls(
            client=client,
            round=round_,
            submitted_s=round(submitted_s, 6),
            prompt_tokens=r.prompt_tokens,
            output_tokens=len(r.tokens),
            ttft_s=r.ttft_s,
            total_s=r.total_s,
            device_hit_tokens=r.device_hit_tokens,
            host_hit_tokens=r.host_hit_tokens,
            storage_hit_tokens=r.storage_hit_tokens,
            preemptions=r.preemptions,
            finish_reason=r.finish_reason,
        )

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.device_hit_tokens - self.host_hit_tokens - self.storage_hit_tokens


def percentiles(seconds: list[float]) -> dict[str, float]:
    """`ttft_p50_s`, `ttft_p90_s`, `ttft_p99_s` of `seconds` (zeros when empty)."""
    if not seconds:
        return {f"ttft_p{q}_s": 0.0 for q in (50, 90, 99)}
    return {f"ttft_p{q}_s": round(float(np.percentile(seconds, q)), 6) for q in (50, 90, 99)}


def tier_tokens(records: list[RequestRecord]) -> dict[str, int]:
    """Prompt tokens of `records` by tier: `device_hit_tokens`, ..., `miss_tokens`."""
    return {
        "device_hit_tokens": sum(r.device_hit_tokens for r in records),
        "host_hit_tokens": sum(r.host_hit_tokens for r in records),
        "storage_hit_tokens": sum(r.storage_hit_tokens for r in records),
        "miss_tokens": sum(r.miss_tokens for r in records),
    }


def summarize(
    config: str, records: list[RequestRecord], duration_s: float, rounds: int, preemptions: int, cache: dict
) -> dict:
    """A configuration's JSON summary (bench/RESULTS.md's multi-turn tables show its main fields)."""
    inputs = sum(r.prompt_tokens for r in records)
    outputs = sum(r.output_tokens for r in records)
    per_round = []
    for k in range(1, rounds + 1):
        these = [r for r in records if r.round == k]
        per_round.append(
            {
                "round": k,
                "requests": len(these),
                **percentiles([r.ttft_s for r in these]),
                **tier_tokens(these),
            }
        )
    return {
        "config": config,
        "requests": len(records),
        "duration_s": round(duration_s, 4),
        "requests_per_s": round(len(records) / duration_s, 4),
        "input_tokens": inputs,
        "output_tokens": outputs,
        "input_tokens_per_s": round(inputs / duration_s, 2),
        "output_tokens_per_s": round(outputs / duration_s, 2),
        **percentiles([r.ttft_s for r in records]),
        "latency_p50_s": round(float(np.percentile([r.total_s for r in records], 50)), 6),
        **tier_tokens(records),
        "preemptions": preemptions,
        "per_round": per_round,
        "cache": cache,
        "records": [asdict(r) for r in records],
    }


def header(meta: dict) -> str:
    """The workload and its working set against the device KV budget, in tokens and GB."""
    w, gb = meta["workload"], 1e9
    loop = "closed loop" if w["request_rate"] is None else f"{w['request_rate']:g} rounds/s (Poisson)"
    sizes = f"context {w['context_tokens']}, question {w['question_tokens']}, output {w['output_tokens']}"
    ws, dev = meta["working_set_tokens"], meta["device_tokens"]
    return (
        f"{meta['model']}, {meta['dtype']}: {w['clients']} clients x {w['rounds']} rounds ({sizes} tokens), "
        f"{loop}\nworking set {w['clients']} x {meta['final_conversation_tokens']} = {ws} tokens "
        f"({meta['working_set_bytes'] / gb:.2f} GB of KV) against a device KV budget of {dev} tokens "
        f"({meta['device_kv_bytes'] / gb:.2f} GB): {meta['working_set_over_device']}x"
    )


def ratio_line(meta: dict) -> str:
    r = meta.get("ratios") or {}
    ttft, thr = r.get("ttft_p50_kvtier_over_device_only"), r.get("throughput_kvtier_over_device_only")
    if not ttft or thr is None:
        return "kvtier / device-only: needs both configurations (and nonzero TTFTs)"
    change = f"{1 / ttft:.1f}x lower" if ttft < 1 else f"{ttft:.1f}x higher"
    return f"kvtier / device-only: TTFT p50 {ttft:.3f} ({change}), throughput {thr:.2f}x"


def render(configs: list[dict], meta: dict) -> Group:
    """The summary table, the TTFT p50 per round, and the kvtier / device-only ratios."""
    main = Table(title=f"Multi-turn on {meta.get('gpu', meta['device'])}")
    cols = ("config", "req/s", "in tok/s", "out tok/s", "TTFT p50 s", "p90 s", "p99 s")
    for col in (*cols, "device hit", "host hit", "storage hit", "miss", "preempt"):
        main.add_column(col, justify="left" if col == "config" else "right")
    for c in configs:
        main.add_row(
            c["config"],
            f"{c['requests_per_s']:.3f}",
            f"{c['input_tokens_per_s']:.0f}",
            f"{c['output_tokens_per_s']:.1f}",
            *(f"{c[f'ttft_p{q}_s']:.4f}" for q in (50, 90, 99)),
            *(str(c[f"{t}_hit_tokens"]) for t in TIERS[:3]),
            str(c["miss_tokens"]),
            str(c["preemptions"]),
        )
    rounds = Table(title="TTFT p50 per round, seconds")
    rounds.add_column("config")
    for k in range(len(configs[0]["per_round"]) if configs else 0):
        rounds.add_column(str(k + 1), justify="right")
    for c in configs:
        rounds.add_row(c["config"], *(f"{r['ttft_p50_s']:.4f}" for r in c["per_round"]))
    return Group(header(meta), main, rounds, ratio_line(meta))


def write_plot(path: Path, configs: list[dict], meta: dict) -> None:
    """A PNG: TTFT p50 per round (left) and prompt tokens per tier (right), one series per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in configs:
        xs = [r["round"] for r in c["per_round"]]
        left.plot(xs, [r["ttft_p50_s"] for r in c["per_round"]], marker="o", label=c["config"])
    left.set(xlabel="round", ylabel="TTFT p50 (s)", title="TTFT per round", ylim=(0, None))
    left.set_xticks(range(1, len(configs[0]["per_round"]) + 1) if configs else [])
    left.legend()
    names = [c["config"] for c in configs]
    bottom = np.zeros(len(configs))
    for tier in TIERS:
        key = "miss_tokens" if tier == "miss" else f"{tier}_hit_tokens"
        values = np.array([c[key] for c in configs], dtype=float)
        right.bar(names, values, bottom=bottom, label=tier)
        bottom += values
    right.set(ylabel="prompt tokens", title="Prompt tokens by where their KV came from")
    right.legend()
    w = meta["workload"]
    fig.suptitle(
        f"{meta['model']}: {w['clients']} clients x {w['rounds']} rounds, working set "
        f"{meta['working_set_over_device']}x the device KV budget"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
