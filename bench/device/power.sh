#!/usr/bin/env bash
# Device calls 7-8 of 2026-11-30 (second session): SM clock and power beside the matmul, alone and
# with a reload through the kernel or the copy engine (probe_power.py); nvidia-smi samples at 50 ms.
source bench/device/setup.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
  --format=csv,noheader -lms 50 > "$R/smi.csv" &
smi=$!
python3 bench/device/probe_power.py 2>&1 | tee "$R/phases.jsonl"
kill $smi
python3 bench/device/smi_by_phase.py "$R/smi.csv" "$R/phases.jsonl"
tar czf "$OUT/call7.tgz" -C "$R" .
