#!/usr/bin/env bash
# Device call 4 of 2026-11-30 (fourth session): GPU tests after the loop takes its arguments as
# one array; the reload bench in four processes; the matmul beside host -> device copies made
# by cudaMemcpyBatchAsync with and without the PreferOverlapWithCompute hint.
source bench/device/setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_cache.py \
  -k "cuda or native or layers or loop or round_trip" 2>&1 | tail -2 | tee "$R/pytest.txt"
reload_in_processes
python3 bench/device/probe_ce_interference.py 1 0 0 3 2>&1 | tee "$R/ce_batch_hint.jsonl" | tail -20
tar czf "$OUT/call4.tgz" -C "$R" .
