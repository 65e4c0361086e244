#!/usr/bin/env bash
# Device call 2 of 2026-11-30 (second session): the final line-rate tables with the planner as
# committed (loads of long host runs onto scattered device slots through staging, backups by the
# kernel), small rows, duplex and interference; then a per-function profile of the 128k-token
# match + load_back (issue 4). Everything lands in one archive (the device returns few files).
source bench/device/setup.sh
python3 -m pytest -q -x tests/test_transfer.py -k "cuda" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
$b transfer --json "$R/transfer.json" 2>&1 | tee "$R/transfer.log" | grep "│" | grep -v stock | tail -40
$b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned,stock \
  --kernel-sweep 16x50 --json "$R/fp8.json" 2>&1 | tee "$R/small.log" | tail -8
$b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned,stock \
  --kernel-sweep 16x128 --json "$R/indexer1.json" 2>&1 | tee -a "$R/small.log" | tail -8
$b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16,runs-64 --device-sets scattered \
  --variants planned,stock --json "$R/indexer16.json" 2>&1 | tee -a "$R/small.log" | tail -8
$b overlap --json "$R/overlap.json" 2>&1 | tee "$R/overlap.log" | tail -12
python3 bench/device/probe_reload_cpu.py 2>&1 | tee "$R/reload_cpu_profile.txt"
tar czf "$OUT/call2.tgz" -C "$R" .
