#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 4: layer groups with the layers addressed by a stride (DevicePool
# now allocates a buffer's layers together); DSA indexer and glm-5 at page 1, fully scattered.
source bench/device/setup.sh
b="python3 -m kvtier.cli bench transfer --layout page_first --host-sets runs-1 --device-sets scattered --variants planned"
run() { name=$1; shift; timeout 120 $b "$@" --json "$R/$name.json" 2>&1 | grep -E "│|ceiling" | tail -4; }
run idx8 --spec glm-5-indexer --layers 8
run idx16 --spec glm-5-indexer --layers 16
run idx32 --spec glm-5-indexer --layers 32
run idx78 --spec glm-5-indexer --layers 78 --tokens 65536
run glm5_8 --spec glm-5 --layers 8 --tokens 65536
run glm5fp8_8 --spec glm-5-fp8 --layers 8 --tokens 65536
tar czf "$OUT/call4.tgz" -C "$R" .
