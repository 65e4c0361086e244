#!/usr/bin/env bash
# Overlapped mixed plans against the same plans run serially, on one lease: the GPU tests of the
# executor's paths, `kvtier calibrate --force`, then per spec `kvtier bench transfer --variants
# planned,serial` (the default planner; `serial` is timed right after `planned` wherever the plan
# overlaps its direct kernel parts with its copy-engine parts). One JSON keyed by spec, and each spec's
# run alone (line_rate_<spec>_..._overlap.json, meta.spec set). Then the calibration's first-use time
# per spec's row sizes on a fresh Triton cache (and again warm).
# OVERLAP_SPECS (default: glm-5 deepseek-v3-fp8-packed deepseek-v3 llama-3.1-8b); TAG names the files
# (default _overlap); CAL_TIME=0 skips the first-use times, TESTS=0 the GPU tests.
# Usage: bash bench/device/overlap_ab.sh
source bench/device/setup.sh
TAG=${TAG:-_overlap}
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py tests/test_transfer.py \
    > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1; tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"
fi
(time $KV calibrate --force --json "$SCRATCH/calibration.json") 2>&1 | grep -E "calibrated|real"
for spec in ${OVERLAP_SPECS:-glm-5 deepseek-v3-fp8-packed deepseek-v3 llama-3.1-8b}; do
  timeout "${SPEC_TIMEOUT:-120}" $KV bench transfer --spec "$spec" --variants planned,serial \
    --direction "${DIRECTION:-both}" --repeats 10 --json "$SCRATCH/overlap_${spec}.json" "${SMOKE_TRANSFER[@]}" \
    > "$SCRATCH/overlap.log" 2>&1 || tail -3 "$SCRATCH/overlap.log"
  cp "$SCRATCH/overlap_${spec}.json" "$OUT/line_rate_${spec}_${GPU}_${DATE}${TAG}.json"
  rows_line "$spec" "$SCRATCH/overlap_${spec}.json"
done
python3 bench/device/results.py combine "$OUT/overlap_ab_${GPU}_$DATE${TAG}.json" \
  $(for f in "$SCRATCH"/overlap_*.json; do echo "$(basename "$f" .json)=$f"; done)
{ [ "${SMOKE:-0}" = 1 ] || [ "${CAL_TIME:-1}" = 0 ]; } && exit 0
for rows in 132,1152 656 1152 2048; do  # glm-5, packed fp8, deepseek-v3, llama-3.1-8b
  export TRITON_CACHE_DIR=$SCRATCH/triton_$rows
  for label in fresh warm; do
    timeout 60 python3 bench/probes/probe_calibration_time.py "$OUT/calibration_time_${GPU}_${DATE}_per_spec.jsonl" \
      "$label" "$rows" | tail -1
  done
done
