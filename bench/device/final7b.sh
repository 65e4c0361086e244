#!/usr/bin/env bash
# Seventh session of 2026-11-30, call 3: pipelining for whole 128-byte lines only. GPU tests of the
# kernels and transfers; the transfer table (deepseek-v3 bf16, layer_first); small rows (unpipelined).
source bench/device/setup.sh
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py tests/test_groups.py \
  -k "cuda or kernel or groups or layers or indexing" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench transfer"
timeout 200 $b --variants planned,kernel,stock --repeats 10 --kernel-sweep 4x113s1,8x56s1,4x56 \
  --json "$R/transfer.json" 2>&1 | grep -E "│|ceiling" | tail -50
s="$b --host-sets runs-1 --device-sets scattered --variants planned --repeats 10"
timeout 60 $s --spec deepseek-v3-fp8-packed --json "$R/fp8.json" 2>&1 | grep -E "│|ceiling" | tail -3
timeout 60 $s --spec glm-5-indexer --json "$R/idx1.json" 2>&1 | grep -E "│|ceiling" | tail -3
timeout 60 $s --spec glm-5-indexer --page-size 16 --json "$R/idx16.json" 2>&1 | grep -E "│|ceiling" | tail -3
timeout 60 $s --spec llama-3.1-8b --json "$R/mha.json" 2>&1 | grep -E "│|ceiling" | tail -3
tar czf "$OUT/call${CALL:-3}.tgz" -C "$R" .
