#!/usr/bin/env bash
# README "Overlap and interference": `kvtier bench overlap` (duplex; a bf16 matmul beside a reload through
# the copy engine, the kernel as planned and the kernel on its whole budget), 3 rounds each after the
# matmul's rate settles, as committed in line_rate_overlap_h200_2026-11-30_s7.json (~5 minutes).
# Usage, from the repository root on the GPU machine: bash bench/device/overlap.sh
source bench/device/setup.sh
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
timeout 540 $KV bench overlap --rounds 3 --json "$OUT/line_rate_overlap_${GPU}_$DATE.json" \
  --rounds-log "$OUT/overlap_rounds_${GPU}_$DATE.jsonl" "${SMOKE_OVERLAP[@]}" 2>&1 \
  | tee "$OUT/line_rate_overlap_${GPU}_$DATE.log" | grep -E "│|wrote"
