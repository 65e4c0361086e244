#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 2: 132-byte indexer rows, G layers of a token at once, read
# from the host in 16-byte lanes (probe_split_rows.py), against the library kernel's 4-byte lanes.
source bench/device/setup.sh
p="python3 bench/device/probe_split_rows.py"
timeout 100 $p "$R/split4.jsonl" 4 124x8,248x8,124x16 2>&1 | tail -8
timeout 100 $p "$R/split8.jsonl" 8 62x8,124x8,62x16 2>&1 | tail -7
timeout 100 $p "$R/split16.jsonl" 16 31x8,62x8,31x16 2>&1 | tail -7
tar czf "$OUT/call2.tgz" -C "$R" .
