#!/usr/bin/env bash
# Device call 4 of 2026-11-30 (second session): loads onto scattered device slots with the final
# staging threshold (64 KiB), and the matmul's loss beside the gather kernel launched as clusters.
source bench/device/setup.sh
python3 -m pytest -q tests/test_transfer.py -k "cuda" -p no:cacheprovider 2>&1 | tail -1 | tee "$R/pytest.txt"
python3 -m kvtier.cli bench transfer --direction load --host-sets runs-256,runs-64,contiguous-churn,first_fit-churn \
  --device-sets scattered --variants planned,kernel,staged --json "$R/loads_scattered.json" 2>&1 \
  | tee "$R/loads_scattered.log" | grep "│" | tail -16
python3 bench/device/probe_cluster.py 2>&1 | tee "$R/cluster.jsonl"
tar czf "$OUT/call4.tgz" -C "$R" .
