"""`kvtier bench multiturn`'s reports: reading them back, their tables and their plot.

A report is `{"meta": ..., "tables": [...]}`: per table (an answer length, or a trace) its
label and sizes, `runs` (each repeat's order of configurations and their summaries,
`kvtier.bench.multiturn_stats.summarize`), `spread` and `ratios` (`aggregate`). Several
reports of the same comparison (say in two orders) are kept as `{"reports": [...]}`.
`load` reads any of these, and a report of the older shape (`{"meta", "configs"}`: one run,
summaries without warm/cold or ITL), whose summaries it rebuilds from their records.

`render` is a report's tables: every figure is the median over repeats with (min-max) where
there are several; `render_agreement` shows whether several reports' ranges overlap.
`write_plot` is the PNG (matplotlib, imported only there, on the Agg backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from kvtier.bench.multiturn_stats import (
    FIGURES,
    RATIOS,
    TIERS,
    RequestRecord,
    aggregate,
    agreement,
    spread,
    summarize,
)

ROWS = (  # (label, figure, digits); digits below 0: milliseconds with -digits decimals
    ("requests/s", "requests_per_s", 3),
    ("output tokens/s", "output_tokens_per_s", 1),
    ("input tokens/s", "input_tokens_per_s", 0),
    ("warm TTFT p50 s", "warm_ttft_p50_s", 3),
    ("warm TTFT p90 s", "warm_ttft_p90_s", 3),
    ("warm TTFT p99 s", "warm_ttft_p99_s", 3),
    ("cold TTFT p50 s", "cold_ttft_p50_s", 3),
    ("ITL p50 ms", "itl_p50_s", -1),
    ("ITL p90 ms", "itl_p90_s", -1),
    ("ITL p99 ms", "itl_p99_s", -1),
    ("longest step s", "longest_step_s", 2),
    ("CPU s (process)", "cpu_s", 1),
    ("CPU share", "cpu_share", 2),
)
BUSY_SHARE = 0.8  # a run that got less of its threads' CPU time waited for the machine's other work
COUNTS = (
    ("host hit tokens", "host_hit_tokens"),
    ("miss tokens", "miss_tokens"),
    ("preemptions", "preemptions"),
)


def load(report: dict) -> list[dict]:
    """The reports in `report` (one, several, or one of the older shape), each `{"meta", "tables"}`."""
    if "reports" in report:
        return [r for one in report["reports"] for r in load(one)]
    if "tables" in report:  # spreads and ratios anew, as this version aggregates
        tables = [{**t, **aggregate(t["runs"])} if t.get("runs") else t for t in report["tables"]]
        return [{**report, "tables": tables}]
    meta, w = report["meta"], report["meta"]["workload"]
    configs = []
    for c in report["configs"]:
        records = [RequestRecord.from_dict(r) for r in c["records"]]
        configs.append(summarize(c["config"], records, c["duration_s"], c["preemptions"], c["cache"], {}))
    table = {
        "label": f"output {w['output_tokens']}",
        "conversations": w["clients"],
        "requests": w["clients"] * w["rounds"],
        "output_tokens": w["output_tokens"],
        "working_set_tokens": meta["working_set_tokens"],
        "working_set_bytes": meta["working_set_bytes"],
        "working_set_over_device": meta["working_set_over_device"],
        "runs": [{"repeat": 1, "order": [c["config"] for c in configs], "configs": configs}],
    }
    table.update(aggregate(table["runs"]))
    return [{"meta": meta, "tables": [table]}]


def cell(s: dict | None, digits: int) -> str:
    """A spread as `median`, or `median (min-max)` over several repeats; `-` for none."""
    if s is None:
        return "-"
    scale, d = (1000.0, -digits) if digits < 0 else (1.0, digits)
    med = f"{s['median'] * scale:.{d}f}"
    return med if s["n"] == 1 else f"{med} ({s['min'] * scale:.{d}f}-{s['max'] * scale:.{d}f})"


def header(meta: dict) -> str:
    w = meta["workload"]
    if w.get("trace"):
        what = f"trace {w['trace']}"
    else:
        loop = "closed loop" if w.get("request_rate") is None else f"{w['request_rate']:g} rounds/s (Poisson)"
        what = (
            f"{w['clients']} clients x {w['rounds']} rounds (context {w['context_tokens']}, question "
            f"{w['question_tokens']} tokens), {loop}"
        )
    runs = f"{meta.get('repeats', 1)} repeat(s), order {meta.get('order', 'fixed')}"
    return f"{meta['model']}, {meta['dtype']} on {meta.get('gpu', meta['device'])}: {what}; {runs}"


def ratio_line(table: dict) -> str:
    r = table.get("ratios") or {}
    warm, cold = (
        r.get("warm_ttft_p50_kvtier_over_device_only"),
        r.get("cold_ttft_p50_kvtier_over_device_only"),
    )
    thr = r.get("throughput_kvtier_over_device_only")
    if not warm or not thr:
        return "kvtier / device-only: needs both configurations (and warm turns)"

    def times(s: dict) -> str:
        m = s["median"]
        word = f"{1 / m:.2f}x lower" if m < 1 else f"{m:.2f}x higher"
        return word if s["n"] == 1 else f"{word} ({s['min']:.3f}-{s['max']:.3f} of device-only's)"

    out = f"kvtier / device-only, warm turns: TTFT p50 {times(warm)}; throughput {cell(thr, 2)}x"
    return out + (f"; cold turns: TTFT p50 {times(cold)}" if cold else "")


def render_table(table: dict, meta: dict) -> Group:
    """One table: a row per figure, a column per configuration and the kvtier / device-only ratio."""
    dev, gb = meta["device_tokens"], 1e9
    title = (
        f"{table['label']}: {table['conversations']} conversations, {table['requests']} requests; "
        f"working set {table['working_set_tokens']} tokens ({table['working_set_bytes'] / gb:.2f} GB of KV), "
        f"{table['working_set_over_device']}x the device budget of {dev} tokens"
    )
    configs, runs = list(table["spread"]), table["runs"]
    out = Table(title=title)
    out.add_column("median (min-max)")
    for col in (*configs, "kvtier / device-only"):
        out.add_column(col, justify="right")
    ratio_of = {f: table.get("ratios", {}).get(r) for r, f in RATIOS.items()}
    for label, key, digits in ROWS:
        cells = [cell(table["spread"][c].get(key), digits) for c in configs]
        out.add_row(label, *cells, cell(ratio_of.get(key), 3))
    for label, key in COUNTS:
        out.add_row(label, *(cell(spread([s[key] for s in summaries(runs, c)]), 0) for c in configs), "")
    n = max((len(s["per_round"]) for run in runs for s in run["configs"]), default=0)
    for k in range(n):
        label = f"round {k + 1} TTFT p50 s" + (" (cold)" if k == 0 else "")
        out.add_row(label, *(cell(spread(per_round(runs, c, k)), 3) for c in configs), "")
    return Group(out, ratio_line(table), "")


def summaries(runs: list[dict], config: str) -> list[dict]:
    """`config`'s summary in each repeat."""
    return [s for run in runs for s in run["configs"] if s["config"] == config]


def per_round(runs: list[dict], config: str, k: int) -> list[float | None]:
    """Round `k + 1`'s TTFT p50 of `config` in each repeat."""
    return [s["per_round"][k]["ttft_p50_s"] for s in summaries(runs, config) if k < len(s["per_round"])]


def render(report: dict) -> Group:
    """A report's header, the machine's load over its runs, and its tables."""
    meta = report["meta"]
    done = [t for t in report["tables"] if t.get("spread")]  # a run cut short: the tables it finished
    return Group(header(meta), machine_line(report), *(render_table(t, meta) for t in done))


def machine_line(report: dict) -> str:
    """torch's threads, the cores, the 1-minute load average around the runs, and how many runs got
    less than `BUSY_SHARE` of their threads' CPU time (a busy machine: their wall-clock figures
    include waiting for a core)."""
    summaries = [s for t in report["tables"] for run in t.get("runs", ()) for s in run["configs"]]
    loads = [s["machine"][k] for s in summaries if s.get("machine") for k in ("load_before", "load_after")]
    meta = report["meta"]
    out = f"{meta['threads']} torch thread(s) on {meta['cores']} cores; " if "threads" in meta else ""
    out += f"load average {min(loads):.1f}-{max(loads):.1f} over the runs" if loads else ""
    shares = [x for x in (FIGURES["cpu_share"](s) for s in summaries) if x is not None]
    busy = sum(x < BUSY_SHARE for x in shares)
    if busy:
        out += (
            f"\n{busy} of {len(shares)} runs got under {BUSY_SHARE:.0%} of their threads' CPU time (CPU "
            "share): the machine was busy, their wall-clock figures include waiting for a core; CPU s is "
            "the work done"
        )
    return out


def render_agreement(reports: list[dict], what: str = "report") -> Group:
    """Per table of the same label in every report: each figure's range per report, and whether they
    overlap (the figures agree within their spread)."""
    parts = []
    for table in reports[0]["tables"]:
        same = [
            next((t for t in r["tables"] if t["label"] == table["label"] and t.get("spread")), None)
            for r in reports
        ]
        if any(t is None for t in same):
            continue
        t = Table(title=f"{table['label']}: each {what}'s median (min-max); orders {orders_of(same)}")
        for col in ("config", "figure", *(f"{what} {i + 1}" for i in range(len(reports))), "overlap"):
            t.add_column(col, justify="left" if col in ("config", "figure") else "right")
        digits = {key: d for _, key, d in ROWS}
        rows = agreement(same)
        for row in rows:
            d = 3 if row["config"] == "kvtier / device-only" else digits.get(row["figure"], 3)
            overlap = {True: "yes", False: "NO", None: "one repeat"}[row["overlap"]]
            t.add_row(row["config"], row["figure"], *(cell(s, d) for s in row["spreads"]), overlap)
        told = [r["overlap"] for r in rows if r["overlap"] is not None]
        parts += [t, f"{sum(told)} of {len(told)} figures with a range overlap across the {what}s", ""]
    return Group(*parts)


def orders_of(tables: list[dict]) -> str:
    """Each table's orders of configurations, `;` between its repeats' distinct orders."""
    return " | ".join("; ".join(dict.fromkeys(",".join(r["order"]) for r in t["runs"])) for t in tables)


def by_order(report: dict) -> list[dict]:
    """`report` split by the order its repeats ran the configurations in: a report per order."""
    orders = list(dict.fromkeys(tuple(r["order"]) for t in report["tables"] for r in t.get("runs", ())))
    out = []
    for order in orders:
        tables = []
        for t in report["tables"]:
            runs = [r for r in t.get("runs", ()) if tuple(r["order"]) == order]
            tables.append({**t, "runs": runs, **aggregate(runs)} if runs else {**t, "runs": []})
        out.append({"meta": report["meta"], "tables": tables})
    return out


def write_plot(path: Path, report: dict) -> None:
    """A PNG, a row per table: TTFT p50 per round (left; median over repeats) and prompt tokens per
    tier (right; the first repeat), one series per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    tables = report["tables"]
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 4.5 * len(tables)), squeeze=False)
    for (left, right), table in zip(axes, tables, strict=True):
        first = table["runs"][0]["configs"]
        n = max(len(c["per_round"]) for c in first)
        for config in table["spread"]:
            ys = [
                (spread(per_round(table["runs"], config, k)) or {"median": np.nan})["median"]
                for k in range(n)
            ]
            left.plot(range(1, n + 1), ys, marker="o", label=config)
        left.set(
            xlabel="round", ylabel="TTFT p50 (s)", title=f"{table['label']}: TTFT per round", ylim=(0, None)
        )
        left.set_xticks(range(1, n + 1))
        left.legend()
        names = [c["config"] for c in first]
        bottom = np.zeros(len(first))
        for tier in TIERS:
            key = "miss_tokens" if tier == "miss" else f"{tier}_hit_tokens"
            values = np.array([c[key] for c in first], dtype=float)
            right.bar(names, values, bottom=bottom, label=tier)
            bottom += values
        right.set(ylabel="prompt tokens", title="Prompt tokens by where their KV came from")
        right.legend()
    fig.suptitle(header(report["meta"]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
