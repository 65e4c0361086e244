#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 3: layer groups in the library (page_first, page 1, fully
# scattered): calls over 1 layer against calls over several, DSA indexer, packed fp8 MLA, bf16.
source bench/device/setup.sh
b="python3 -m kvtier.cli bench transfer --layout page_first --host-sets runs-1 --device-sets scattered --variants planned"
run() { name=$1; shift; timeout 120 $b "$@" --json "$R/$name.json" 2>&1 | grep -E "│|ceiling" | tail -4; }
run idx1 --spec glm-5-indexer --layers 1
run idx16 --spec glm-5-indexer --layers 16
run idx32 --spec glm-5-indexer --layers 32
run fp8_1 --spec deepseek-v3-fp8-packed --layers 1
run fp8_4 --spec deepseek-v3-fp8-packed --layers 4
run fp8_8 --spec deepseek-v3-fp8-packed --layers 8
run glm5_8 --spec glm-5 --layers 8 --tokens 65536
run dsv3_4 --spec deepseek-v3 --layers 4 --tokens 65536
tar czf "$OUT/call3.tgz" -C "$R" .
