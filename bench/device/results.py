"""Helper of the device scripts: combine several bench JSONs into one.

`combine OUT.json KEY=PATH ...` writes `{KEY: <PATH's JSON>, ...}` (a missing or unreadable
PATH becomes `{"error": ...}`, so one failed process does not lose the others).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("combine")
    c.add_argument("out", type=Path)
    c.add_argument("pairs", nargs="*", help="KEY=PATH")
    args = p.parse_args()
    combine(args.out, args.pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
