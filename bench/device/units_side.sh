#!/usr/bin/env bash
# Issue 21: the kernel's units on the second stream before the direct kernel parts, in their own
# place of the staging buffer (`staging.units_apart`), against the same plans with the units' part at
# the start of the staging buffer (so before the fork where the two grids do not fit `sm_budget`).
# `glm-5` and packed fp8, DIRECTIONS (default both), onto scattered device slots, ROUNDS rounds (default 2),
# alternating, each a process of `kvtier bench transfer` (planned, then serial). The GPU tests of the
# planner, the executor and the cost model first (the machine's versions at the log's head). Then,
# with TABLE=1, the per-spec table (`overlap_ab.sh`, this TAG, no tests or calibration-time runs). Usage: bash bench/device/units_side.sh
source bench/device/setup.sh
TAG=${TAG:-_units_side}
{ env_info; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py tests/test_transfer.py \
  tests/test_costs.py; } > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1; tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_${DATE}${TAG}.json") 2>&1 | grep -E "calibrated|real"

# `kvtier` with every units' part left at the start of the staging buffer.
AT_START=(python3 -c "import sys
from kvtier.transfer import plan
plan.staging.units_apart = lambda parts, *args, **kwargs: parts
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))")
bench() {  # KEY SPEC DIRECTION [command...]: one process, its JSON kept under KEY
  local key=$1 spec=$2 direction=$3; shift 3
  local cmd=("$@"); [ ${#cmd[@]} = 0 ] && cmd=(python3 -m kvtier)
  timeout 150 "${cmd[@]}" bench transfer --spec "$spec" --variants planned,serial --direction "$direction" \
    --host-sets runs-256,runs-64,runs-16,contiguous-churn,first_fit-churn --device-sets scattered --repeats 10 \
    --json "$SCRATCH/$key.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/$key.log" 2>&1 || tail -3 "$SCRATCH/$key.log"
  python3 -c "import json; d = json.load(open('$SCRATCH/$key.json'))
print('$key', ' '.join(f\"{r['host_runs']}:{r['variant']}={r['ceiling_ratio']}\" for r in d['rows']))"
}
for round in $(seq "${ROUNDS:-2}"); do
  for spec in glm-5 deepseek-v3-fp8-packed; do
    for direction in ${DIRECTIONS:-backup load}; do
      bench "${spec}_${direction}_side_r$round" "$spec" "$direction"
      bench "${spec}_${direction}_start_r$round" "$spec" "$direction" "${AT_START[@]}"
    done
  done
done
python3 bench/device/results.py combine "$OUT/units_side_${GPU}_$DATE$TAG.json" \
  $(for f in "$SCRATCH"/*.json; do echo "$(basename "$f" .json)=$f"; done)
[ "${TABLE:-0}" = 1 ] && TAG=$TAG TESTS=0 CAL_TIME=0 SPEC_TIMEOUT=115 bash bench/device/overlap_ab.sh
exit 0
