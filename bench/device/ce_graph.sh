#!/usr/bin/env bash
# Device call 6 of 2026-11-30 (third session): the matmul beside copy-engine copies, eager launches
# against launches replayed from a CUDA graph (probe_ce_interference.py, one eager pair first).
source bench/device/setup.sh
python3 bench/device/probe_ce_interference.py 1 0 3 2>&1 | tee "$R/ce_graph.jsonl"
tar czf "$OUT/call6.tgz" -C "$R" .
