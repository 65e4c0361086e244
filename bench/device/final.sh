#!/usr/bin/env bash
# Device call 5 of 2026-11-30 (second session), on the final code: every GPU test, the full
# line-rate table, and the 128k-token reload through match + load_back at page sizes 1 and 16.
source bench/device/setup.sh
python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -3 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
$b transfer --json "$R/transfer.json" 2>&1 | tee "$R/transfer.log" | grep "│" | grep planned | tail -30
for ps in 1 16; do
  $b cache --parts reload --reload-repeats 9 --page-size $ps --json "$R/cache_reload_page$ps.json" 2>&1 \
    | tee "$R/cache_page$ps.log" | grep -v "^reload:" | tail -4
done
tar czf "$OUT/call5.tgz" -C "$R" .
