#!/usr/bin/env bash
# Follow-up line-rate run for small rows: packed fp8 MLA (656 B), the DSA indexer at page 1
# (132 B) and at page 16 (2112-byte pages), planned path and a few kernel shapes, GPU tests first.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/line_rate_small.log"
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest.txt"
k=python3; b="-m kvtier.cli bench"
$k $b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 8x50,16x50 --json "$OUT/fp8.json" 2>&1 | tee -a "$log" | tail -12
$k $b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 8x128,16x128 --json "$OUT/indexer1.json" 2>&1 | tee -a "$log" | tail -12
$k $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16,runs-64 --device-sets scattered \
  --variants planned --json "$OUT/indexer16.json" 2>&1 | tee -a "$log" | tail -12
