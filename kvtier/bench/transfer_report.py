"""What `kvtier bench transfer` reports of its rows: per cell the best forced variant and the planned
one's gap to it (`cells`), and the tables it prints (`render`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table

if TYPE_CHECKING:
    from kvtier.bench.transfer import Row


def cells(rows: list[Row]) -> list[dict]:
    """One dict per cell (tokens, direction, host set, device set): each variant's share of the ceiling,
    the best forced one, how far the planned one lies from it (`gap`, negative: planned slower), and
    which variants ran another's plan and took its time (`same_plan`: variant -> the one timed), and
    per variant whether the host took longer to issue a call than the device to run it (`host_bound`)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        cell = out.setdefault(
            (r.tokens, r.direction, r.host_runs, r.device),
            {
                "tokens": r.tokens,
                "direction": r.direction,
                "host": r.host_runs,
                "device": r.device,
                "runs": r.host_run_count,
                "ratios": {},
                "identical": True,
            },
        )
        cell["ratios"][r.variant] = r.ceiling_ratio
        cell.setdefault("host_bound", {})[r.variant] = r.issue_ms > r.ms
        cell["identical"] &= r.identical
        if r.same_plan_as:
            cell.setdefault("same_plan", {})[r.variant] = r.same_plan_as
        if r.planned:
            cell["path"] = r.path
    for cell in out.values():
        forced = {v: x for v, x in cell["ratios"].items() if v not in ("planned", "fixed")}
        best = max(forced, key=forced.__getitem__) if forced else None
        cell["best_forced"] = best
        planned = cell["ratios"].get("planned")
        gap = None if best is None or planned is None else round(planned - forced[best], 3)
        cell["gap"] = gap
        fixed = cell["ratios"].get("fixed")
        cell["vs_fixed"] = None if fixed is None or planned is None else round(planned - fixed, 3)
    return list(out.values())


def render(rows: list[Row], metas: list[dict]) -> Group:
    """The tables `kvtier bench transfer` prints: per size, a row per cell with every variant's share of
    the ceiling, the best forced variant and the planned one's gap to it."""
    first = metas[0]
    where = first.get("gpu") or first.get("cpu")
    buffers = ", ".join(f"{n} {b} B" for n, b in first["buffers"].items())
    variants = sorted({r.variant for r in rows}, key=lambda v: (v != "planned", v))
    out = []
    for meta in metas:
        mine = [r for r in rows if r.tokens == meta["tokens"]]
        title = (
            f"{meta['spec']} ({buffers}), one layer of {meta['tokens']} tokens "
            f"({meta['layer_bytes'] / 1e6:.1f} MB per call), {meta['layout']}, page {meta['page_size']}, "
            f"on {where}; ceiling " + ", ".join(f"{d} {g} GB/s" for d, g in meta["ceiling_gbps"].items())
        )
        table = Table(title=title)
        for col in (
            "direction",
            "host slots",
            "runs",
            "device",
            "planned path",
            *variants,
            "best",
            "gap",
            "ok",
        ):
            table.add_column(col, justify="left" if col in ("direction", "host slots", "device") else "right")
        for c in cells(mine):
            gap = c["gap"]
            shown = "" if gap is None else (f"[red]{gap:+.3f}[/red]" if gap < -0.02 else f"{gap:+.3f}")
            table.add_row(
                c["direction"],
                c["host"],
                str(c["runs"]),
                c["device"],
                c.get("path", ""),
                *(f"{c['ratios'][v]:.3f}" if v in c["ratios"] else "" for v in variants),
                c["best_forced"] or "",
                shown,
                "yes" if c["identical"] else "[red]NO[/red]",
            )
        out.append(table)
    note = (
        "shares of the same-run ceiling; best: the fastest forced variant; gap: planned minus best "
        "(red below -0.02); ok: byte-identical to the source, nothing else written"
    )
    return Group(*out, note)
