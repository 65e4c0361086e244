#!/usr/bin/env bash
# Device call 5 of 2026-11-30 (fourth session): the matmul beside a copy-engine reload, single
# copies plain against one-copy batched calls with the PreferOverlapWithCompute hint,
# alternating in blocks of 5 rounds (3 blocks each).
source bench/device/setup.sh
python3 bench/device/probe_overlap_hint.py 3 5 "$R/overlap_hint.jsonl" 2>&1 | grep "^{" | tee "$R/overlap_hint.log"
tar czf "$OUT/call5.tgz" -C "$R" .
