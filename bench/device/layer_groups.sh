#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 1: scattered small rows moved G layers of a token at a time
# (page_first host layout, page size 1), probe_layer_groups.py, on 8 and then 4 programs.
source bench/device/setup.sh
timeout 240 python3 bench/device/probe_layer_groups.py "$R/groups8.jsonl" 132,656,1152 1,2,4,8,16 8 2>&1 | tail -20
timeout 150 python3 bench/device/probe_layer_groups.py "$R/groups4.jsonl" 132,656 1,4,8 4 2>&1 | tail -10
tar czf "$OUT/call1.tgz" -C "$R" .
