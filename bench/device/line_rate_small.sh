#!/usr/bin/env bash
# Follow-up line-rate runs: the DSA indexer at page 16 with the committed rows-in-flight rule, and
# interference of the gather kernel with a matmul at sm_budget 4 (vs 8 in line_rate.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/line_rate_small.log"
k=python3; b="-m kvtier.cli bench"
$k $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16,runs-64 --device-sets scattered \
  --variants planned,kernel --kernel-sweep 8x32,8x64,4x64 --json "$OUT/indexer16.json" 2>&1 | tee -a "$log" | tail -14
for shape in 4x32 4x64; do
  $k $b overlap --kernel $shape --json "$OUT/overlap_$shape.json" 2>&1 | tee -a "$log" | tail -9
done
