#!/usr/bin/env bash
# Device call 11 of 2026-11-30 (third session): GPU tests of the native loop, cache and transfers after
# the lazily made per-layer signals and the lighter table; the 128k reload's CPU cost in four processes.
source bench/device/setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_cache.py tests/test_transfer.py \
  -k "cuda or native or tape or raw or signals" 2>&1 | tail -2 | tee "$R/pytest.txt"
reload_in_processes
tar czf "$OUT/call11.tgz" -C "$R" .
