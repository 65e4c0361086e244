#!/usr/bin/env bash
# Seventh session of 2026-11-30, call 5: the final code on another lease. GPU tests of the kernels and
# transfers; interference and duplex (bench overlap, duplex now timed on the GPU); the transfer table
# (deepseek-v3 bf16, layer_first); small rows and 2048-byte rows fully scattered, one layer per call.
source bench/device/setup.sh
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py tests/test_groups.py \
  -k "cuda or kernel or groups or layers or indexing" -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
timeout 300 $b overlap --rounds 3 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
timeout 150 $b transfer --variants planned,kernel,stock --repeats 10 --json "$R/transfer.json" 2>&1 \
  | grep -E "│|ceiling" | grep -v stock | tail -40
s="$b transfer --host-sets runs-1 --device-sets scattered --variants planned --repeats 10"
for spec in deepseek-v3-fp8-packed glm-5-indexer llama-3.1-8b; do
  timeout 45 $s --spec $spec --json "$R/$spec.json" 2>&1 | grep -E "│" | tail -2
done
timeout 45 $s --spec glm-5-indexer --page-size 16 --json "$R/glm-5-indexer-page16.json" 2>&1 | grep -E "│" | tail -2
tar czf "$OUT/call${CALL:-5}.tgz" -C "$R" .
