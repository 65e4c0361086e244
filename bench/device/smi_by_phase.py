"""Median SM clock and power per phase: nvidia-smi samples (CSV) against phases with host times.

Usage: smi_by_phase.py SMI_CSV PHASES_JSONL. The CSV is `nvidia-smi --query-gpu=timestamp,
clocks.sm,clocks.mem,power.draw,power.limit,... --format=csv,noheader -lms 50`; each JSON line has
`start` and `end` (`time.time()`), `tflops`, and `phase` or `mechanism` + `reload` (the overlap
bench's `--rounds-log`). The first half second of a phase is left out (the clock settles).
"""

import csv
import datetime
import json
import statistics
import sys


def main(smi_csv: str, phases_jsonl: str) -> None:
    with open(phases_jsonl) as fh:
        phases = [json.loads(ln) for ln in fh if ln.startswith("{")]
    with open(smi_csv) as fh:
        lines = list(csv.reader(fh))
    rows = []
    for line in lines:
        try:
            t = datetime.datetime.strptime(line[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(line[1].split()[0]), float(line[3].split()[0]), line[4].strip()))
        except (ValueError, IndexError):
            continue
    for p in phases:
        name = p.get("phase") or f"{p['mechanism']} {'beside reload' if p['reload'] else 'alone'}"
        inside = [x for x in rows if p["start"] + 0.5 < x[0] < p["end"]]
        if inside:
            clock = statistics.median(x[1] for x in inside)
            power = statistics.median(x[2] for x in inside)
            print(
                f"{name:>26}: {p['tflops']:6.1f} TFLOP/s, SM clock {clock:.0f} MHz, "
                f"power {power:.0f} W of {inside[0][3]} ({len(inside)} samples)"
            )


if __name__ == "__main__":
    main(*sys.argv[1:3])
