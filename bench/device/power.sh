#!/usr/bin/env bash
# Device calls 7-8 of 2026-11-30 (second session): SM clock and power beside the matmul, alone and
# with a reload through the kernel or the copy engine (probe_power.py); nvidia-smi samples at 50 ms.
source bench/device/setup.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
  --format=csv,noheader -lms 50 > "$R/smi.csv" &
smi=$!
python3 bench/device/probe_power.py 2>&1 | tee "$R/phases.jsonl"
kill $smi
python3 - "$R" <<'PY'
import csv, datetime, json, statistics, sys
r = sys.argv[1]
phases = [json.loads(l) for l in open(f"{r}/phases.jsonl") if l.startswith("{")]
rows = []
for line in csv.reader(open(f"{r}/smi.csv")):
    try:
        t = datetime.datetime.strptime(line[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(line[1].split()[0]), float(line[3].split()[0]), line[4].strip()))
    except (ValueError, IndexError):
        continue
for p in phases:
    inside = [x for x in rows if p["start"] + 0.5 < x[0] < p["end"]]
    if inside:
        limit = inside[0][3]
        print(f"{p['phase']:>14}: {p['tflops']:6.1f} TFLOP/s, SM clock {statistics.median(x[1] for x in inside):.0f} MHz, "
              f"power {statistics.median(x[2] for x in inside):.0f} W of {limit}")
PY
tar czf "$OUT/call7.tgz" -C "$R" .
