"""Helpers of the device scripts: combine several bench JSONs into one, and summarise a re-run.

`combine OUT.json KEY=PATH ...` writes `{KEY: <PATH's JSON>, ...}` (a missing or unreadable
PATH becomes `{"error": ...}`, so one failed process does not lose the others).

`summary --transfer T --cache C --served S --committed DIR` prints the re-measured tables of
`redesign.sh` beside the committed figures in DIR: every planned transfer row against
`line_rate_transfer_h200_2026-11-30_s7.json` (flagged when more than 0.01 below it), each
reload process against the range of `cache_reload_h200_2026-11-30_s4.json`, each served row
against `served_h200_2026-11-29.json`. A file that is missing or has another shape is named,
not fatal: the summary prints what it can.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COMMITTED_TRANSFER = "line_rate_transfer_h200_2026-11-30_s7.json"
COMMITTED_CACHE = "cache_reload_h200_2026-11-30_s4.json"
COMMITTED_SERVED = "served_h200_2026-11-29.json"
# A planned row this far below its committed ratio fails issue 17's check.
TOLERANCE = 0.01


def _load(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        print(f"  (no file {path})")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"  (cannot read {path}: {e})")
        return None


def combine(out: Path, pairs: list[str]) -> None:
    """Write one JSON object keyed by run from `KEY=PATH` pairs."""
    merged = {}
    for pair in pairs:
        key, _, path = pair.partition("=")
        try:
            merged[key] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            merged[key] = {"error": str(e)}
    out.write_text(json.dumps(merged, indent=1))
    print(f"wrote {out} ({len(merged)} runs)")


def _planned(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["direction"], r["host_runs"], r["device"]): r for r in rows if r.get("planned")}


def summarise_transfer(new: dict | None, old: dict | None) -> int:
    """Print the planned rows against the committed ones; the number more than TOLERANCE below."""
    print("line rate (planned path, of ceiling): new / committed")
    if not new or "rows" not in new:
        print("  no transfer rows")
        return 0
    ceiling = new.get("meta", {}).get("ceiling_gbps")
    print(f"  ceiling GB/s: {ceiling}")
    before = _planned(old["rows"]) if old and "rows" in old else {}
    low = 0
    for key, r in _planned(new["rows"]).items():
        ref = before.get(key)
        mark = ""
        if ref is not None and r["ceiling_ratio"] < ref["ceiling_ratio"] - TOLERANCE:
            mark, low = "  LOW", low + 1
        committed = f"{ref['ceiling_ratio']:.3f} {ref['path']}" if ref else "-"
        ok = "" if r.get("identical", True) else "  NOT IDENTICAL"
        row = f"{key[0]:7} {key[1]:17} {key[2]:11} {r['path']:12}"
        print(f"  {row} {r['ceiling_ratio']:.3f} / {committed}{mark}{ok}")
    print(f"  planned rows more than {TOLERANCE} below the committed value: {low}")
    return low


def summarise_cache(new: dict | None, old: dict | None) -> None:
    """Print each reload process (CPU, match, reload ratio, first layer) and the committed range."""
    print("cache reload: CPU us, of which match us, reload / ideal, first layer ms, backup / ideal")
    for key, run in (new or {}).items():
        r = run.get("reload") if isinstance(run, dict) else None
        if not r:
            print(f"  {key:18} {run.get('error', 'no reload row') if isinstance(run, dict) else run}")
            continue
        print(
            f"  {key:18} {r['cpu_us']:7.0f} {r['match_us']:6.0f} {r.get('ratio')} {r.get('first_layer_ms')}"
            f" {r.get('backup_ratio')} ({r.get('tokens')} tokens, {r.get('host_runs')} host runs,"
            f" {r.get('repeats')} repeats)"
        )
    # The committed file is keyed by device call; its last call ran the final code.
    calls = [c for c in (old or {}).values() if isinstance(c, dict)]
    runs = [
        x["reload"] for x in (calls[-1].values() if calls else ()) if isinstance(x, dict) and "reload" in x
    ]
    cpu = [r["cpu_us"] for r in runs if r.get("host_runs") == 1]
    if cpu:
        print(f"  committed, one host run, {len(cpu)} processes: {min(cpu):.0f}-{max(cpu):.0f} us")


def summarise_served(new: dict | None, old: dict | None) -> None:
    """Print each served row (TTFT of miss, device hit, host hit; reload ratio) against the committed one."""
    print("served TTFT, s: miss / device hit / host hit, reload ratio (committed ratio)")
    before = {(r["setup"], r["config"], r["prefix_tokens"]): r for r in (old or {}).get("rows", [])}
    for r in (new or {}).get("rows", []):
        ref = before.get((r["setup"], r["config"], r["prefix_tokens"]))
        committed = f"{ref['reload_overhead_ratio']:.2f}" if ref else "-"
        print(
            f"  {r['setup']:12} {r['config']:7} {r['prefix_tokens']:7} {r['ttft_miss_s']:.4f} "
            f"{r['ttft_device_hit_s']:.4f} {r['ttft_host_hit_s']:.4f} "
            f"{r['reload_overhead_ratio']:.2f} ({committed})"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("combine")
    c.add_argument("out", type=Path)
    c.add_argument("pairs", nargs="*", help="KEY=PATH")
    s = sub.add_parser("summary")
    s.add_argument("--transfer", type=Path)
    s.add_argument("--cache", type=Path)
    s.add_argument("--served", type=Path)
    s.add_argument("--committed", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    if args.command == "combine":
        combine(args.out, args.pairs)
        return 0
    low = summarise_transfer(_load(args.transfer), _load(args.committed / COMMITTED_TRANSFER))
    summarise_cache(_load(args.cache), _load(args.committed / COMMITTED_CACHE))
    summarise_served(_load(args.served), _load(args.committed / COMMITTED_SERVED))
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
