"""The `kvtier` command: `kvtier bench transfer ...` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvtier.errors import KVTierError
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.spec import PRESETS, preset

# Wide enough for the tables when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 132)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Hierarchical KV cache for LLM serving.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    t = bench.add_parser("transfer", help="host <-> device transfer paths at every fragmentation")
    t.add_argument("--spec", choices=sorted(PRESETS), help="KV spec preset (default: deepseek-v3)")
    t.add_argument("--tokens", type=int, help="prefix length (default: 131072 on CUDA, 16384 on CPU)")
    t.add_argument("--page-size", type=int, default=1)
    t.add_argument("--layout", choices=[m.value for m in HostLayout], default=HostLayout.LAYER_FIRST.value)
    t.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    t.add_argument("--direction", choices=["load", "backup", "both"], default="both")
    t.add_argument("--repeats", type=int, help="timed repeats per row (default: 20 on CUDA, 5 on CPU)")
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--batch", type=int, default=4, help="back-to-back calls per timed sample")
    t.add_argument("--cycles", type=int, default=8, help="fill/evict cycles before the churn rows")
    t.add_argument("--json", type=Path, help="also write the rows and metadata to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        if args.command == "bench" and args.bench == "transfer":
            return _bench_transfer(args)
    except KVTierError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    return 1


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvtier.bench.transfer import BenchConfig, rows_as_dicts, run

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    cuda = device.type == "cuda"
    spec = preset(args.spec or "deepseek-v3", args.page_size).with_layers(1)
    tokens = args.tokens or (131072 if cuda else 16384)
    if tokens <= 0 or tokens % spec.page_size:
        console.print(f"[red]error:[/red] --tokens {tokens} must be a positive multiple of --page-size")
        return 2
    directions = (
        (Direction.LOAD, Direction.BACKUP) if args.direction == "both" else (Direction(args.direction),)
    )
    cfg = BenchConfig(
        spec=spec,
        tokens=tokens,
        layout=HostLayout(args.layout),
        device=device,
        repeats=args.repeats or (20 if cuda else 5),
        warmup=args.warmup,
        cycles=args.cycles,
        batch=args.batch,
        directions=directions,
    )
    if console.is_terminal:
        with console.status("starting") as status:
            rows, meta = run(cfg, progress=lambda msg: status.update(msg))
    else:
        rows, meta = run(cfg, progress=lambda msg: console.print(msg, highlight=False))

    where = meta.get("gpu") or meta.get("cpu")
    title = (
        f"{spec.name}, one layer of {tokens} tokens ({meta['layer_bytes'] / 1e6:.0f} MB), "
        f"{cfg.layout.value}, "
        f"page {spec.page_size}, on {where}; ceiling "
        + ", ".join(f"{d} {g} GB/s" for d, g in meta["ceiling_gbps"].items())
    )
    table = Table(title=title)
    for col in (
        "direction",
        "host slots",
        "runs",
        "device",
        "path",
        "GB/s",
        "of ceiling",
        "identical",
    ):
        table.add_column(col, justify="right" if col in ("runs", "GB/s", "of ceiling") else "left")
    for r in rows:
        path = f"[bold]{r.path}[/bold]*" if r.planned else r.path
        ok = "yes" if r.identical else "[red]NO[/red]"
        table.add_row(
            r.direction,
            r.host_runs,
            str(r.host_run_count),
            r.device,
            path,
            f"{r.gbps:.1f}",
            f"{r.ceiling_ratio:.2f}",
            ok,
        )
    console.print(table)
    console.print("* the path the planner picks")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows_as_dicts(rows)}, indent=1))
        console.print(f"wrote {args.json}")
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
