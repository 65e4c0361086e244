#!/usr/bin/env bash
# Device call 8 of 2026-11-30 (third session): rows in flight per program for the small rows on 8 SMs,
# fully scattered: packed fp8 (656 B, default 99 rows) and DSA indexer rows at page 1 (132 B, 256).
source bench/device/setup.sh
b="python3 -m kvtier.cli bench transfer --host-sets runs-1 --device-sets scattered --variants planned"
$b --spec deepseek-v3-fp8-packed --kernel-sweep 8x64,8x128,8x160,8x200 --json "$R/fp8_sweep.json" 2>&1 \
  | grep "│" | tail -12
tar czf "$OUT/call8.tgz" -C "$R" .
$b --spec glm-5-indexer --kernel-sweep 8x512,8x1024 --json "$R/indexer_sweep.json" 2>&1 | grep "│" | tail -8
tar czf "$OUT/call8.tgz" -C "$R" .
