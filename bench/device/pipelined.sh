#!/usr/bin/env bash
# Seventh session of 2026-11-30: the gather kernel's loop pipelined into shared memory
# (probe_pipelined.py): rates of scattered 1152-byte rows per shape, then the matmul beside some.
source bench/device/setup.sh
python3 bench/device/probe_pipelined.py "$R/pipelined.jsonl" \
  "${SHAPES:-4x113x32x0,8x56x16x0,4x56x16x1,4x56x16x3,4x56x16x4,3x56x16x3,3x56x16x4,2x56x16x4,4x56x32x4,3x56x32x4,2x56x32x4}" \
  "${MM_SHAPES:-4x113x32x0,4x56x16x4,3x56x16x4,2x56x16x4}" "${PASSES:-2}" 2>&1 | grep -v "^ *$" | tail -80
tar czf "$OUT/call${CALL:-1}.tgz" -C "$R" .
