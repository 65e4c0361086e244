#!/usr/bin/env bash
# Fifth session of 2026-11-30: what the gather kernel's SMs cost the matmul at several grid sizes,
# tiles and warp counts (probe_sm_cost.py; call 1 also ran the spin kernels: SPIN=spin).
source bench/device/setup.sh
python3 bench/device/probe_sm_cost.py "$R/sm_cost.jsonl" "${PASSES:-2}" "${SHAPES:-8x56x16,4x113x16,4x113x32,2x227x32}" \
  ${SPIN:-} 2>&1 | grep -v "^ *$" | tail -60
tar czf "$OUT/call${CALL:-1}.tgz" -C "$R" .
