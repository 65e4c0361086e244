#!/usr/bin/env bash
# Issue 21 in one call: `kvtier calibrate --force` (its run time and the choices per spec), the
# line-rate table per spec on the default planner, the calibrated model (`specs.sh`: one JSON per spec,
# meta.spec set),
# with SERVED=1 the GLM-5-shaped served setup at 8k, 32k and 128k (one repeat, one churn cycle: the
# stock configuration's per-token transfers of 13 GB take most of that), then glm-5 again on the
# thresholds (KVTIER_CALIBRATION=off). Usage: [SPECS=...] [SERVED=1] bash bench/device/issue21.sh
source bench/device/setup.sh
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_$DATE.json") 2>&1 | tee "$SCRATCH/calibration.log" \
  | grep -E "calibrated|real"
SPECS=${SPECS:-glm-5,deepseek-v3,llama-3.1-8b,deepseek-v3-fp8-packed} LOG_DIR=$SCRATCH VARIANTS=planned PAGE_FIRST=${PAGE_FIRST:-none} \
  bash bench/device/specs.sh 2>&1 | grep -E "==|ceiling:"
if [ "${SERVED:-0}" = 1 ]; then
  timeout "${SERVED_TIMEOUT:-330}" $KV bench served --setups glm-5 --prefix "${PREFIX:-8192,32768,131072}" --repeats 1 \
    --cycles 1 --json "$OUT/served_glm-5_${GPU}_$DATE.json" "${SMOKE_SERVED[@]}" 2>&1 \
    | tee "$OUT/served_glm-5_${GPU}_$DATE.log" | grep -vE "^ *$" | tail -12
fi
# The planner on the thresholds (the fallback: KVTIER_CALIBRATION=off), for comparison.
KVTIER_CALIBRATION=off SPECS=${THRESHOLD_SPECS:-glm-5} TAG=_thresholds LOG_DIR=$SCRATCH VARIANTS=planned PAGE_FIRST=none \
  bash bench/device/specs.sh 2>&1 | grep -E "==|ceiling:"
