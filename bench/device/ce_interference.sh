#!/usr/bin/env bash
# Device call 5 of 2026-11-30 (third session): the matmul beside copy-engine copies with in-process
# NVML clock and power samples (probe_ce_interference.py); then the 128k-token reload's CPU cost in
# two more processes per page size (how much it varies between processes on one machine).
source bench/device/setup.sh
python3 bench/device/probe_ce_interference.py 3 0 0 2>&1 | tee "$R/ce_interference.jsonl"
tar czf "$OUT/call5.tgz" -C "$R" .
reload_in_processes
tar czf "$OUT/call5.tgz" -C "$R" .
