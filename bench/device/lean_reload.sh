#!/usr/bin/env bash
# Device call 1 of 2026-11-30 (fourth session): GPU tests of the loop that computes a reload's
# addresses from its runs, the cache and transfers; the 128k reload's CPU cost by stage with that
# loop and with the numpy table, alternating in one process per page size.
source bench/device/setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_cache.py tests/test_transfer.py \
  -k "cuda or native or tape or raw or signals or layers or loop" 2>&1 | tail -3 | tee "$R/pytest.txt"
python3 bench/device/probe_reload_stages.py "$R/stages.jsonl" 2>&1 | tail -8
tar czf "$OUT/call1.tgz" -C "$R" .
