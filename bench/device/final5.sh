#!/usr/bin/env bash
# Fifth session of 2026-11-30. Call 3: the kernel's tiles sized by its budget (64 KiB on 8 programs,
# 128 KiB on 32 warps for 4): the matmul beside the kernel on 8 and 4 SMs, kernel rows on 4 SMs,
# small rows. Call 4 (CALL=4): the lean kernel (rows of 1 KiB or more on 4 of the 8 programs) as
# the default: GPU tests, the overlap bench (lean and whole budget), the transfer table, DSA pages.
source bench/device/setup.sh
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -k "cuda or kernel" -p no:cacheprovider 2>&1 \
  | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
if [ "${CALL:-3}" = 3 ]; then
  $b overlap --sm-budgets 4 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
  $b transfer --kernel 4 --variants planned,kernel --host-sets runs-256,runs-64,runs-16,runs-1,first_fit-churn \
    --json "$R/transfer_sm4.json" 2>&1 | grep "│" | tail -24
  $b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned,stock \
    --kernel-sweep 4 --json "$R/fp8.json" 2>&1 | grep "│" | tail -8
  $b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned \
    --kernel-sweep 4,16 --json "$R/indexer1.json" 2>&1 | grep "│" | tail -8
  $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered --variants planned \
    --kernel-sweep 4 --json "$R/indexer16.json" 2>&1 | grep "│" | tail -8
else
  timeout 320 $b overlap --rounds 4 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
  timeout 170 $b transfer --variants planned,kernel,stock --repeats 10 --json "$R/transfer.json" 2>&1 \
    | grep "│" | grep -v stock | tail -44
  $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered --variants planned,kernel \
    --kernel 8x31 --json "$R/indexer16_whole.json" 2>&1 | grep "│" | tail -4
  $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered --variants planned \
    --json "$R/indexer16.json" 2>&1 | grep "│" | tail -4
fi
tar czf "$OUT/call${CALL:-3}.tgz" -C "$R" .
