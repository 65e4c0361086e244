#!/usr/bin/env bash
# Issue 21, the calibration's run time with its kernel shapes compiled ahead from threads
# (`calibrate.COMPILE_THREADS`, 8) against one after another (1), on a fresh and a warm Triton cache,
# for glm-5's rows and every preset's; first the GPU tests of the planner, executor and calibration,
# and `kvtier calibrate --force` timed whole. With TABLE=1, then the line-rate table (`table_transfer`,
# deepseek-v3 bf16, README "Line rate at every fragmentation"). Usage: [TABLE=1] bash bench/device/compile_ahead.sh
source bench/device/setup.sh
env_info > "$OUT/env_compile_ahead_${GPU}_$DATE.txt" 2>&1
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py tests/test_transfer.py tests/test_costs.py \
  > "$OUT/gpu_tests_${GPU}_${DATE}_compile_ahead.log" 2>&1
tail -2 "$OUT/gpu_tests_${GPU}_${DATE}_compile_ahead.log"
times=$OUT/calibration_time_${GPU}_${DATE}_compile_ahead.jsonl
for rows in 132,1152 132,576,656,1152,2048; do  # glm-5; every preset's
  for threads in 1 8; do
    export TRITON_CACHE_DIR=$SCRATCH/triton_${rows}_$threads
    for label in fresh warm; do
      COMPILE_THREADS=$threads timeout 60 python3 bench/probes/probe_calibration_time.py "$times" "$label" "$rows" \
        | tail -1
    done
  done
done
export TRITON_CACHE_DIR=$SCRATCH/triton_cli
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_${DATE}_compile_ahead.json") 2>&1 \
  | grep -E "calibrated|real"
if [ "${TABLE:-0}" = 1 ]; then
  table_transfer "line_rate_transfer_${GPU}_${DATE}_overlap" 200
fi
