#!/usr/bin/env bash
# Issue 21, two questions on one lease, each a process of `kvtier bench transfer`, ROUNDS rounds
# (default 2), alternating:
# - the backups' staging floor (`PathCosts.backup_staged_floor_bytes`, 384 KiB of the widest rows):
#   the kernel against staging by the copy engine, forced, and the planner's plan, on `deepseek-v3`
#   and `glm-5` backups of host runs of 256-384 rows (295-442 KB of 1152-byte rows) onto scattered
#   device slots;
# - the indexer riding with the latent's staged host runs (`splits.split_all`) against its own
#   choice, `glm-5` loads of runs-256, runs-16 and after churn, device slots scattered and
#   contiguous (planned, then serial).
# One calibration for all. TAG names the files (default _riders). Usage: bash bench/device/riders.sh
source bench/device/setup.sh
TAG=${TAG:-_riders}
env_info > "$OUT/env_${GPU}_$DATE$TAG.txt" 2>&1
[ "${TESTS:-1}" = 1 ] && { timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py \
  tests/test_transfer.py tests/test_costs.py > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1
  tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"; }
(time $KV calibrate --force --json "$OUT/calibration_${GPU}_${DATE}${TAG}.json") 2>&1 | grep -E "calibrated|real"

# `kvtier` whose small-row buffers never ride with the widest buffer's staged host runs.
NO_RIDE=(python3 -c "import sys
from kvtier.transfer import splits
alone = splits.split_all
splits.split_all = lambda groups, found, n, min_average, *share: alone(groups, found, n, float('inf'), *share)
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))")
bench() {  # KEY SPEC DIRECTION HOST_SETS DEVICE_SETS VARIANTS [command...]: one process, its JSON kept under KEY
  local key=$1 spec=$2 direction=$3 sets=$4 devices=$5 variants=$6; shift 6
  local cmd=("$@"); [ ${#cmd[@]} = 0 ] && cmd=(python3 -m kvtier)
  timeout 150 "${cmd[@]}" bench transfer --spec "$spec" --variants "$variants" --direction "$direction" \
    --host-sets "$sets" --device-sets "$devices" --repeats 10 \
    --json "$SCRATCH/$key.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/$key.log" 2>&1 || tail -3 "$SCRATCH/$key.log"
  python3 -c "import json; d = json.load(open('$SCRATCH/$key.json'))
print('$key', ' '.join(f\"{r['host_runs']}/{r['device'][:4]}:{r['variant']}={r['ceiling_ratio']}:{'+'.join(sorted({m for v in r.get('mechanisms', {}).values() for m in v}))}\" for r in d['rows']))"
}
for round in $(seq "${ROUNDS:-2}"); do
  for spec in deepseek-v3 glm-5; do
    bench "${spec}_floor_r$round" "$spec" backup runs-256,runs-300,runs-340,runs-384 scattered planned,kernel,staged
  done
  sets=runs-256,runs-16,contiguous-churn,first_fit-churn
  bench "glm-5_ride_r$round" glm-5 load "$sets" scattered,contiguous planned,serial
  bench "glm-5_alone_r$round" glm-5 load "$sets" scattered,contiguous planned,serial "${NO_RIDE[@]}"
done
python3 bench/device/results.py combine "$OUT/riders_floor_${GPU}_$DATE$TAG.json" \
  $(for f in "$SCRATCH"/*.json; do echo "$(basename "$f" .json)=$f"; done)
exit 0
