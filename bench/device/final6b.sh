#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 8: layer groups with ~80 KiB per program, through the library
# (page_first, page 1, fully scattered): DSA indexer at 16, 32 and 78 layers per call, packed fp8
# and glm-5 at 8; GPU tests of the layer-group kernel.
source bench/device/setup.sh
timeout 60 python3 -m pytest -q -x tests/test_groups.py -p no:cacheprovider 2>&1 | tail -1 | tee "$R/pytest.txt"
g="python3 -m kvtier.cli bench transfer --layout page_first --host-sets runs-1 --device-sets scattered --variants planned"
run() { name=$1; shift; timeout 100 $g "$@" --json "$R/$name.json" 2>&1 | grep -E "│|ceiling" | tail -4; }
run idx16 --spec glm-5-indexer --layers 16
run idx32 --spec glm-5-indexer --layers 32
run idx78 --spec glm-5-indexer --layers 78 --tokens 65536
run fp8_8 --spec deepseek-v3-fp8-packed --layers 8
run glm5_8 --spec glm-5 --layers 8 --tokens 65536
tar czf "$OUT/call8.tgz" -C "$R" .
