#!/usr/bin/env bash
# Device call 3 of 2026-11-30 (second session): the cache's GPU tests and the 128k-token reload's
# CPU cost after moving the per-layer copy and event record to raw runtime calls, the device slot
# ids to views of the allocator's id table, and dtype sizes off torch.empty; then its profile again.
source bench/device/setup.sh
python3 -m pytest -q tests/test_cache.py tests/test_transfer.py tests/test_engine.py tests/test_alloc.py \
  -k "cuda or engine or raw or views" -p no:cacheprovider 2>&1 | tail -3 | tee "$R/pytest.txt"
for ps in 1 16; do
  python3 -m kvtier.cli bench cache --parts reload --reload-repeats 9 --page-size $ps \
    --json "$R/cache_reload_page$ps.json" 2>&1 | tee "$R/cache_page$ps.log" | grep -v "^reload:" | tail -5
done
python3 bench/device/probe_reload_cpu.py 2>&1 | tee "$R/reload_cpu_profile.txt"
tar czf "$OUT/call3.tgz" -C "$R" .
