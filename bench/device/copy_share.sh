#!/usr/bin/env bash
# Issue 21: an overlapped backup hands the copy engine a share of what the kernel moves alone
# (`PathCosts.backup_copy_share`, `splits.shared`). On one lease: the GPU tests of the planner, the
# executor and the cost model; the per-spec table with the share (`overlap_ab.sh`, TESTS=0, this TAG);
# then, per spec, backups without the share (`backup_copy_share=0`), onto both device sets, in one
# process each, against the table's backups. TAG names the files (default _copy_share); TESTS=0 skips
# the tests, DIRECTION=backup times the table's backups only.
# Usage: bash bench/device/copy_share.sh
source bench/device/setup.sh
TAG=${TAG:-_copy_share}
[ "${TESTS:-1}" = 1 ] && { timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py \
  tests/test_transfer.py tests/test_costs.py > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1
  tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"; }
TAG=$TAG TESTS=0 CAL_TIME=0 SPEC_TIMEOUT=115 bash bench/device/overlap_ab.sh

# `kvtier` with the planner's default costs but no share for the copy engine.
NO_SHARE=(python3 -c "import functools, sys
from kvtier.transfer import options, plan
plan.PathCosts = functools.partial(options.PathCosts, backup_copy_share=0.0)
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))")
for spec in ${SHARE_SPECS:-glm-5 deepseek-v3-fp8-packed deepseek-v3 llama-3.1-8b}; do
  timeout 100 "${NO_SHARE[@]}" bench transfer --spec "$spec" --variants planned --direction backup \
    --host-sets runs-256,runs-64,runs-16,contiguous-churn,first_fit-churn --repeats 10 \
    --json "$SCRATCH/${spec}_no_share.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/no_share.log" 2>&1 \
    || tail -3 "$SCRATCH/no_share.log"
  python3 -c "import json; d = json.load(open('$SCRATCH/${spec}_no_share.json'))
print('$spec no share', ' '.join(f\"{r['host_runs']}/{r['device'][:4]}={r['ceiling_ratio']}\" for r in d['rows']))"
done
python3 bench/device/results.py combine "$OUT/copy_share_ab_${GPU}_$DATE$TAG.json" \
  $(for f in "$SCRATCH"/*_no_share.json; do echo "$(basename "$f" .json)=$f"; done)
exit 0
