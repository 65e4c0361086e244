#!/usr/bin/env bash
# Seventh session of 2026-11-30, call 6: offsets spread from rows in tiles of up to 4096 lanes
# (fp8 rows, unpipelined). GPU tests of the kernels; packed and unpacked fp8 rows fully scattered.
source bench/device/setup.sh
timeout 60 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
s="python3 -m kvtier.cli bench transfer --host-sets runs-1 --device-sets scattered --variants planned --repeats 10"
for spec in deepseek-v3-fp8-packed deepseek-v3-fp8; do
  timeout 40 $s --spec $spec --json "$R/$spec.json" 2>&1 | grep -E "│" | tail -2
done
tar czf "$OUT/call${CALL:-6}.tgz" -C "$R" .
