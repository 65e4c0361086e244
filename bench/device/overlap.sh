#!/usr/bin/env bash
# Device calls 10-11 of 2026-11-30 (second session): `kvtier bench overlap` with 2-second rounds
# (the matmul settled at the power limit), plus SM clock and power sampled beside it.
source bench/device/setup.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 > "$R/smi.csv" &
smi=$!
python3 -m kvtier.cli bench overlap --json "$R/overlap.json" 2>&1 | tee "$R/overlap.log" | tail -12
kill $smi
tar czf "$OUT/call10.tgz" -C "$R" .
