#!/usr/bin/env bash
# The measured cost model against the thresholds on one lease: `kvtier calibrate --force` (its run
# time, copy curve and choices), then per spec `kvtier bench transfer` on the planned path with the
# defaults and with KVTIER_CALIBRATION=on, one after the other; one JSON keyed cal_<spec>_<model>.
# CAL_SPECS (default: llama-3.1-8b deepseek-v3-fp8-packed glm-5), DIRECTION (default both). The
# calibrated run of each spec is also kept alone (line_rate_<spec>_..._calibrated.json, meta.spec set).
# Usage: bash bench/device/calibrated.sh
source bench/device/setup.sh
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_${DATE}.json") 2>&1 | grep -E "calibrated|real"
for spec in ${CAL_SPECS:-llama-3.1-8b deepseek-v3-fp8-packed glm-5}; do
  for model in defaults calibrated; do
    cal=off; [ "$model" = calibrated ] && cal=on
    KVTIER_CALIBRATION=$cal timeout "${SPEC_TIMEOUT:-110}" $KV bench transfer --spec "$spec" --variants planned \
      --direction "${DIRECTION:-both}" --repeats 10 --json "$SCRATCH/cal_${spec}_${model}.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/cal.log" 2>&1 \
      || tail -3 "$SCRATCH/cal.log"
    [ "$model" = calibrated ] && cp "$SCRATCH/cal_${spec}_${model}.json" "$OUT/line_rate_${spec}_${GPU}_${DATE}_calibrated.json"
    python3 -c "import json; d = json.load(open('$SCRATCH/cal_${spec}_${model}.json'))
print('$spec $model', ' '.join(f\"{r['direction'][0]}:{r['host_runs']}/{r['device'][0]}={r['ceiling_ratio']}\" for r in d['rows']))"
  done
done
python3 bench/device/results.py combine "$OUT/calibrated_ab_${GPU}_$DATE.json" \
  $(for f in "$SCRATCH"/cal_*.json; do echo "$(basename "$f" .json)=$f"; done)
