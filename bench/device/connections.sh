#!/usr/bin/env bash
# Issue 21, two questions on one lease, each process of `kvtier bench transfer` on backups onto
# scattered device slots (planned, then serial), one calibration for all:
# - the overlapped `glm-5` backups after churn with the driver's default hardware connections (8)
#   against CUDA_DEVICE_MAX_CONNECTIONS=32, ROUNDS rounds (default 2), alternating;
# - the backups' staging floor (`PathCosts.backup_staged_floor_bytes`) against none, on the
#   runs-256 / runs-64 / churn backups of `glm-5`, `deepseek-v3` and packed fp8, alternating too.
# The GPU tests of the planner, the executor and the cost model first. TAG names the files
# (default _connections). Usage: bash bench/device/connections.sh
source bench/device/setup.sh
TAG=${TAG:-_connections}
env_info > "$OUT/env_${GPU}_$DATE$TAG.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py tests/test_transfer.py tests/test_costs.py \
  > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1; tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_${DATE}${TAG}.json") 2>&1 | grep -E "calibrated|real"

# `kvtier` with the planner's default costs but no backup staging floor.
NO_FLOOR=(python3 -c "import functools, sys
from kvtier.transfer import options, plan
plan.PathCosts = functools.partial(options.PathCosts, backup_staged_floor_bytes=0)
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))")
bench() {  # KEY SPEC HOST_SETS [command...]: one backup process, its JSON kept under KEY
  local key=$1 spec=$2 sets=$3; shift 3
  local cmd=("$@"); [ ${#cmd[@]} = 0 ] && cmd=(python3 -m kvtier)
  timeout 150 "${cmd[@]}" bench transfer --spec "$spec" --variants planned,serial \
    --direction backup --host-sets "$sets" --device-sets scattered --repeats 10 \
    --json "$SCRATCH/$key.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/$key.log" 2>&1 || tail -3 "$SCRATCH/$key.log"
  python3 -c "import json; d = json.load(open('$SCRATCH/$key.json'))
print('$key', ' '.join(f\"{r['host_runs']}:{r['variant']}={r['ceiling_ratio']}:{'+'.join(sorted({m for v in r.get('mechanisms', {}).values() for m in v}))}\" for r in d['rows']))"
}
for round in $(seq "${ROUNDS:-2}"); do
  for conn in 8 32; do
    CUDA_DEVICE_MAX_CONNECTIONS=$conn bench "glm-5_conn${conn}_r$round" glm-5 contiguous-churn,first_fit-churn
  done
  for spec in glm-5 deepseek-v3 deepseek-v3-fp8-packed; do
    sets=runs-256,runs-64,contiguous-churn,first_fit-churn
    bench "${spec}_floor_r$round" "$spec" "$sets"
    bench "${spec}_nofloor_r$round" "$spec" "$sets" "${NO_FLOOR[@]}"
  done
done
python3 bench/device/results.py combine "$OUT/connections_floor_${GPU}_$DATE$TAG.json" \
  $(for f in "$SCRATCH"/*.json; do echo "$(basename "$f" .json)=$f"; done)
