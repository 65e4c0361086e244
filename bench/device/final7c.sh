#!/usr/bin/env bash
# Seventh session of 2026-11-30, call 4: the final code (loads of whole lines pipelined on 2 programs,
# backups as before). GPU tests of the pipelining rules; interference and duplex (bench overlap); the
# transfer table's kernel rows; 2048-byte rows (llama-3.1-8b) and packed fp8 rows at several shapes.
source bench/device/setup.sh
timeout 100 python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -k "pipelined or stages or long_rows or tiles" \
  -p no:cacheprovider 2>&1 | tail -2 | tee "$R/pytest.txt"
b="python3 -m kvtier.cli bench"
timeout 330 $b overlap --rounds 3 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" 2>&1 | grep "│" | tail -12
s="$b transfer --host-sets runs-1 --device-sets scattered --variants planned --repeats 10"
timeout 90 $s --spec llama-3.1-8b --kernel-sweep 4x64s1,8x32s1,4x32,2x32s1 --json "$R/mha.json" 2>&1 | grep -E "│|ceiling" | tail -12
timeout 60 $s --spec deepseek-v3-fp8-packed --kernel-sweep 8x99,16x99s1 --json "$R/fp8.json" 2>&1 | grep -E "│|ceiling" | tail -8
tar czf "$OUT/call${CALL:-4}.tgz" -C "$R" .
