"""The rows and the table of `kvtier bench vllm` (`kvtier.bench.vllm`): per server and prompt
length, the median TTFT of each case, the miss over each hit, and whether the answers agree.

Two checks per row: `identical`, every hit answered as the miss of its prompt did; and, for vLLM,
`same_as_prefix_cache`, every kvtier hit answered as vLLM's own prefix-cache hit of the same
prompt did (the same computation over the same KV bytes: the last block's tokens against the
cached ones). vLLM's CPU kernels may round a whole prefill and a last-block prefill differently
(see tests/test_vllm_connector.py), so the first can fail where the second holds.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from rich.console import Group
from rich.table import Table

HITS = ("host_hit", "storage_hit")


@dataclass
class Row:
    """One server and prompt length: median TTFTs in seconds (None: not measured on this server),
    the miss over each kvtier hit, the answer checks, and every case's samples."""

    server: str
    prompt_tokens: int
    ttft_miss_s: float
    ttft_host_hit_s: float
    ttft_storage_hit_s: float | None
    ttft_no_connector_miss_s: float | None
    ttft_prefix_cache_hit_s: float | None
    miss_over_host: float
    miss_over_storage: float | None
    identical: bool
    same_as_prefix_cache: bool | None
    samples: dict[str, list[float]] = field(default_factory=dict)


def rows_of(server: str, repeats: int, lengths: list[int], samples: dict, answers: dict) -> list[Row]:
    """`samples[(case, n)]`: TTFTs; `answers[(case, n, repeat)]`: texts."""
    rows = []
    for n in lengths:
        med = {case: statistics.median(v) for (case, m), v in samples.items() if m == n}
        hits = [c for c in HITS if c in med]
        same = _agree(answers, n, repeats, hits)
        get = _getter(med)
        storage = med.get("storage_hit")
        rows.append(
            Row(
                server=server,
                prompt_tokens=n,
                ttft_miss_s=round(med["miss"], 4),
                ttft_host_hit_s=round(med["host_hit"], 4),
                ttft_storage_hit_s=get("storage_hit"),
                ttft_no_connector_miss_s=get("no_connector_miss"),
                ttft_prefix_cache_hit_s=get("prefix_cache_hit"),
                miss_over_host=round(med["miss"] / med["host_hit"], 2),
                miss_over_storage=None if storage is None else round(med["miss"] / storage, 2),
                identical=same("miss"),
                same_as_prefix_cache=same("prefix_cache_hit") if "prefix_cache_hit" in med else None,
                samples={c: [round(t, 4) for t in v] for (c, m), v in samples.items() if m == n},
            )
        )
    return rows


def _agree(answers: dict, n: int, repeats: int, hits: list[str]):
    """`same(ref)`: whether every hit of length `n` answered as case `ref` of its prompt did."""
    return lambda ref: all(answers[(c, n, r)] == answers[(ref, n, r)] for c in hits for r in range(repeats))


def _getter(med: dict[str, float]):
    return lambda case: round(med[case], 4) if case in med else None


def answers_of(answers: dict) -> dict[str, str]:
    """The answers for JSON: `"case n repeat"` -> text."""
    return {f"{case} {n} {r}": text for (case, n, r), text in sorted(answers.items())}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def render(report: dict) -> Group:
    """The table: per server and prompt length, median TTFTs, the miss over each hit, the checks."""
    meta = report["meta"]
    what = f"vLLM {meta['vllm']}, {meta['dtype']}, on {meta['device']}"
    table = Table(title=f"TTFT, seconds (median of {meta['repeats']}), {what}")
    cols = ("server", "prompt", "miss", "host hit", "storage hit", "miss/host", "miss/storage")
    for col in (*cols, "same as miss", "same as prefix cache", "no-kvtier miss", "prefix-cache hit"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for r in report["rows"]:
        ratio = r["miss_over_storage"]
        table.add_row(
            r["server"],
            str(r["prompt_tokens"]),
            _s(r["ttft_miss_s"]),
            _s(r["ttft_host_hit_s"]),
            _s(r["ttft_storage_hit_s"]),
            f"{r['miss_over_host']:.1f}x",
            "-" if ratio is None else f"{ratio:.1f}x",
            _yes(r["identical"]),
            _yes(r["same_as_prefix_cache"]),
            _s(r["ttft_no_connector_miss_s"]),
            _s(r["ttft_prefix_cache_hit_s"]),
        )
    cut = [n for n in meta["tokens"] if n > max(meta["lengths"])]
    note = ""
    if cut:
        note = (
            f"prompts of {', '.join(map(str, cut))} tokens do not fit the model's context of "
            f"{meta['context']}: measured at {max(meta['lengths'])}. "
        )
    note += f"vLLM with kvtier: its prefix cache off, storage file://; hits on /metrics: {meta['counted']}"
    return Group(table, note)
