#!/usr/bin/env bash
# Fifth session of 2026-11-30, call 5: small rows with larger tiles now that tiles over 64 KiB run on
# 32 warps (packed fp8 656 B: 8 x 199 rows = 128 KiB per program; DSA 132 B on 16 and 24 programs).
source bench/device/setup.sh
b="python3 -m kvtier.cli bench"
timeout 75 $b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 8x199,16x99,16x199 --json "$R/fp8.json" 2>&1 | grep "│" | tail -8
timeout 75 $b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 16x256,16x496,24x256 --json "$R/indexer1.json" 2>&1 | grep "│" | tail -8
tar czf "$OUT/call5.tgz" -C "$R" .
