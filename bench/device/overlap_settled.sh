#!/usr/bin/env bash
# Device call 6 of 2026-11-30 (fourth session): `kvtier bench overlap` with the warm-up that runs
# matmuls alone until their rate settles (30-150 s) before the measured rounds.
source bench/device/setup.sh
python3 -m kvtier.cli bench overlap --rounds 5 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" \
  2>&1 | grep -v "^ *$" | tail -14
tar czf "$OUT/call6.tgz" -C "$R" .
