#!/usr/bin/env bash
# Device call 7 of 2026-11-30 (third session): the matmul beside host -> device copies paced to 3/4
# and 1/2 of the time (probe_ce_interference.py 1 2 0).
source bench/device/setup.sh
python3 bench/device/probe_ce_interference.py 1 2 0 2>&1 | tee "$R/ce_paced.jsonl"
tar czf "$OUT/call7.tgz" -C "$R" .
