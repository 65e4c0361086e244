#!/usr/bin/env bash
# Device call 4 of 2026-11-30 (third session): GPU tests; the 128k-token reload's CPU cost with the
# compiled submission loop (pages 1 and 16, int32 ids, host copies in 1, 8 and 64 runs); the full
# transfer table after the fan-out threshold (batched copies fan out only while their runs average
# under 1 MiB); packed fp8 rows fully scattered. The archive is rewritten after each stage.
source bench/device/setup.sh
pack() { tar czf "$OUT/call4.tgz" -C "$R" .; }
python3 -m pytest -q tests/test_native.py tests/test_cache.py tests/test_transfer.py \
  -k "cuda or native or tape or raw" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
reload() {  # name, then extra arguments
  local name=$1; shift
  python3 -m kvtier.cli bench cache --parts reload --reload-repeats 15 "$@" \
    --json "$R/reload_$name.json" 2>&1 | grep -v "^reload:" | grep "│" | tail -1
}
reload page1 --page-size 1
reload page16 --page-size 16
reload page1_runs8 --page-size 1 --reload-host-runs 8
reload page1_runs64 --page-size 1 --reload-host-runs 64
pack
b="python3 -m kvtier.cli bench"
$b transfer --json "$R/transfer.json" 2>&1 | tee "$R/transfer.log" | grep "│" | grep -v stock | tail -40
pack
$b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned \
  --json "$R/fp8.json" 2>&1 | tee "$R/small.log" | grep "│" | tail -4
pack
