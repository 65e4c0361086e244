#!/usr/bin/env bash
# Fifth session of 2026-11-30, call 4: the lean kernel (rows of 1 KiB or more on 4 of the 8
# programs, 128 KiB tiles on 32 warps) as the default: GPU tests of kernels and transfers, the
# overlap bench (the kernel as planned and on its whole budget), the transfer table, DSA pages of 16.
# Call 3 ran the kernel rows with `--kernel 4` (host sets runs-256 to first_fit-churn, variants
# planned,kernel), small rows with `--kernel-sweep 4` (and 4,16 for the indexer at page 1), and the
# overlap bench through a since-removed `--sm-budgets 4`, which the whole-budget row replaced.
source bench/device/setup.sh
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -k "cuda or kernel" -p no:cacheprovider 2>&1 \
  | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
timeout 320 $b overlap --rounds 4 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
timeout 170 $b transfer --variants planned,kernel,stock --repeats 10 --json "$R/transfer.json" 2>&1 \
  | grep "│" | grep -v stock | tail -44
$b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered --variants planned,kernel \
  --kernel 8x31 --json "$R/indexer16_whole.json" 2>&1 | grep "│" | tail -4
$b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16 --device-sets scattered --variants planned \
  --json "$R/indexer16.json" 2>&1 | grep "│" | tail -4
tar czf "$OUT/call${CALL:-4}.tgz" -C "$R" .
