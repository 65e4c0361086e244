#!/usr/bin/env bash
# Seventh session of 2026-11-30, call 2: the pipelined kernel through the library. GPU tests of the
# kernels, layer groups and transfers; the transfer table (deepseek-v3 bf16, layer_first) with the old
# shapes beside (4 x 113 rows and 8 x 56 unpipelined, s1) ; small rows pipelined and not.
source bench/device/setup.sh
timeout 150 python3 -m pytest -q -x tests/test_groups.py tests/test_kernels.py tests/test_transfer.py \
  -k "cuda or kernel or groups or layers or indexing" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench transfer"
timeout 200 $b --variants planned,kernel,stock --repeats 10 --kernel-sweep 4x113s1,8x56s1,4x56,8x56,3x56 \
  --json "$R/transfer.json" 2>&1 | grep "│" | tail -50
s="$b --host-sets runs-1 --device-sets scattered --variants planned --repeats 10"
timeout 60 $s --spec deepseek-v3-fp8-packed --kernel-sweep 8x99s1,16x99,4x99 --json "$R/fp8.json" 2>&1 | grep -E "│|ceiling" | tail -8
timeout 60 $s --spec glm-5-indexer --kernel-sweep 8x256s1,8x124,16x124 --json "$R/idx1.json" 2>&1 | grep -E "│|ceiling" | tail -8
timeout 60 $s --spec glm-5-indexer --page-size 16 --kernel-sweep 8x31s1,2x31 --json "$R/idx16.json" 2>&1 | grep -E "│|ceiling" | tail -8
tar czf "$OUT/call${CALL:-2}.tgz" -C "$R" .
