#!/usr/bin/env bash
# One device call: the gather/scatter kernel against the CUDA probe's SM gather, same machine,
# same call: deepseek-v3 (1152 B), packed fp8 (656 B), DSA indexer at page 1 (132 B) and 16.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/kernel_shapes.log"
nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o /tmp/probe bench/device/probe_pcie.cu
for rb in 1152 656; do /tmp/probe $rb vec 1; done > "$OUT/probe_vec.jsonl" 2>&1
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest.txt"
k=python3; b="-m kvtier.cli bench"
$k $b transfer --host-sets runs-16,runs-1 --device-sets contiguous,scattered --variants planned \
  --kernel-sweep 8x32,16x16,16x32 --json "$OUT/k1152.json" 2>&1 | tee -a "$log" | tail -30
$k $b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 8x64,16x32 --json "$OUT/k656.json" 2>&1 | tee -a "$log" | tail -12
$k $b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned \
  --kernel-sweep 16x128,8x256 --json "$OUT/k132.json" 2>&1 | tee -a "$log" | tail -12
$k $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered \
  --variants planned,kernel --json "$OUT/k2112.json" 2>&1 | tee -a "$log" | tail -12
$k $b transfer --host-sets runs-256,runs-64,contiguous-churn,first_fit-churn --device-sets contiguous \
  --variants planned,batched_dma,kernel --json "$OUT/fanout.json" 2>&1 | tee -a "$log" | tail -30
