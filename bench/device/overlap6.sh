#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 9: another lease's interference figures (the matmul beside the
# copy engine, the kernel as planned, the kernel on its whole budget) and kernel rows' line rate.
source bench/device/setup.sh
b="python3 -m kvtier.cli bench"
timeout 300 $b overlap --rounds 3 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
timeout 120 $b transfer --host-sets runs-16,runs-1 --variants planned --repeats 10 --json "$R/transfer.json" 2>&1 \
  | grep -E "│|ceiling" | tail -10
tar czf "$OUT/call9.tgz" -C "$R" .
