#!/usr/bin/env bash
# Issue 21: backups keep 256 KiB in flight (`launch.SCATTER_GRID_BYTES`: 4 programs of 64 KiB tiles
# for rows of 1 KiB or more, where they took 128 KiB). That rule is commit c8fb37d, reverted in the
# next one (bench/FINDINGS.md, dead ends): run this at c8fb37d to repeat the A/B; on later code the
# planned rows use the 128 KiB tiles and the sweep still times both. `kvtier calibrate --force`,
# then per spec the per-spec table's run (`--variants planned,serial`, as overlap_ab.sh), with the kernel forced onto
# fully scattered rows at the old and the new backup tile in the same process (`--kernel-sweep`),
# then the GPU tests of the kernel, the planner and the executor.
# TAG names the files (default _scatter_tiles); TESTS=0 skips the tests.
# Usage: bash bench/device/scatter_tiles.sh
source bench/device/setup.sh
TAG=${TAG:-_scatter_tiles}
env_info > "$OUT/env_${GPU}_${DATE}${TAG}.txt" 2>&1
(time $KV calibrate --force --json "$SCRATCH/calibration.json") 2>&1 | grep -E "calibrated|real"
declare -A SWEEP=([glm-5]=4x113,4x56 [deepseek-v3]=4x113,4x56 [llama-3.1-8b]=4x64,4x32 [deepseek-v3-fp8-packed]=8x99)
for spec in ${SPECS:-glm-5 deepseek-v3 llama-3.1-8b deepseek-v3-fp8-packed}; do
  timeout "${SPEC_TIMEOUT:-110}" $KV bench transfer --spec "$spec" --variants planned,serial \
    --kernel-sweep "${SWEEP[$spec]}" --repeats 10 --json "$SCRATCH/tiles_${spec}.json" > "$SCRATCH/tiles.log" 2>&1 \
    || tail -3 "$SCRATCH/tiles.log"
  cp "$SCRATCH/tiles_${spec}.json" "$OUT/line_rate_${spec}_${GPU}_${DATE}${TAG}.json"
  rows_line "$spec" "$SCRATCH/tiles_${spec}.json"
done
[ -f "$SCRATCH/calibration.json" ] && cp "$SCRATCH/calibration.json" "$OUT/calibration_${GPU}_${DATE}${TAG}.json"
[ "${TESTS:-1}" = 1 ] && { timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  tests/test_transfer.py > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1; tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"; }
exit 0
