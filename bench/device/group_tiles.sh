#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 6: the layer-group kernel's units per program for 132-byte
# indexer rows at G = 8, 16, 32, 78 layers per stretch (probe_group_tiles.py; 0 = the default).
source bench/device/setup.sh
timeout 400 python3 bench/device/probe_group_tiles.py "$R/group_tiles.jsonl" 8,16,32,78 0,6,10,15,20,31,40,62 2>&1 | tail -40
tar czf "$OUT/call6.tgz" -C "$R" .
