#!/usr/bin/env bash
# Sixth session of 2026-11-30, call 7: units per program around ~80 KiB of stretches per program
# (call 6: 40 x 16 layers and 20 x 32 layers loaded at 0.79-0.81, the 64 KiB default at 0.67-0.75).
source bench/device/setup.sh
p="timeout 120 python3 bench/device/probe_group_tiles.py"
$p "$R/tiles8.jsonl" 8 0,70,77,90,0,77 2>&1 | tail -6
$p "$R/tiles16.jsonl" 16 0,36,38,40,44,0,38 2>&1 | tail -7
$p "$R/tiles32.jsonl" 32 0,18,19,20,22,0,19 2>&1 | tail -7
$p "$R/tiles78.jsonl" 78 0,5,7,8,0,7 2>&1 | tail -6
tar czf "$OUT/call7.tgz" -C "$R" .
