#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 5: the final code. GPU tests of the kernels, layer groups and
# transfers; the transfer table (deepseek-v3 bf16, layer_first, one layer per call); page_first at
# page 1, fully scattered, one layer per call against layer groups (DSA indexer, packed fp8, glm-5).
source bench/device/setup.sh
timeout 150 python3 -m pytest -q -x tests/test_groups.py tests/test_kernels.py tests/test_transfer.py \
  -k "cuda or kernel or groups or layers or indexing" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench transfer"
timeout 170 $b --variants planned,kernel,stock --repeats 10 --json "$R/transfer.json" 2>&1 \
  | grep "│" | grep -v stock | tail -44
g="$b --layout page_first --host-sets runs-1 --device-sets scattered --variants planned"
run() { name=$1; shift; timeout 100 $g "$@" --json "$R/$name.json" 2>&1 | grep -E "│|ceiling" | tail -4; }
run idx1 --spec glm-5-indexer --layers 1
run idx16 --spec glm-5-indexer --layers 16
run fp8_1 --spec deepseek-v3-fp8-packed --layers 1
run fp8_8 --spec deepseek-v3-fp8-packed --layers 8
run glm5_1 --spec glm-5 --layers 1 --tokens 65536
run glm5_8 --spec glm-5 --layers 8 --tokens 65536
tar czf "$OUT/call5.tgz" -C "$R" .
