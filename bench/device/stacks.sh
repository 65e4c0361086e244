#!/usr/bin/env bash
# Issue 21, `page_first` stacks: the 2-D line probe (how wide a line of some of a page's layers must be;
# PROBE=0 skips it), then `kvtier bench transfer --layout page_first` with every layer of each spec in
# one call, the planner's plan against the layer-group kernel (VARIANTS, default planned,kernel), with the
# device pool's default staging of 131072 rows (windows of half of it); GLM-5 also cut to 8 layers.
# One JSON (`line_rate_stacks_*`), keyed by run. Usage: bash bench/device/stacks.sh
source bench/device/setup.sh
env_info > "$OUT/env_stacks_${GPU}_$DATE.txt" 2>&1
if [ "${SMOKE:-0}" != 1 ] && [ "${PROBE:-1}" = 1 ]; then
  (cd bench/probes && timeout 120 python3 probe_stack_lines.py "$OUT/stack_lines_probe_${GPU}_$DATE.jsonl" 1152 78) \
    2>&1 | tail -12
fi
log=line_rate_stacks_${GPU}_$DATE runs=()
run() {  # key, then bench transfer arguments
  local key=$1; shift
  echo "== $key: $*" | tee -a "$OUT/$log.log"
  timeout "${RUN_TIMEOUT:-150}" $KV bench transfer --layout page_first --variants "${VARIANTS:-planned,kernel}" \
    --repeats "${REPEATS:-10}" "$@" --json "$SCRATCH/$key.json" "${SMOKE_TRANSFER[@]}" 2>&1 | tee -a "$OUT/$log.log" \
    | grep -E "│|ceiling" | grep -vE "^ *$"
  runs+=("$key=$SCRATCH/$key.json")
}
st=(--staging-tokens 131072)  # the device pool's default at most (151 MB per direction for glm-5)
run glm-5_78 --spec glm-5 --layers 78 --tokens 16384 "${st[@]}" --host-sets contiguous,runs-64,runs-1
run glm-5_8 --spec glm-5 --layers 8 --tokens 65536 "${st[@]}" --host-sets contiguous,runs-64,runs-1
run deepseek-v3_61 --spec deepseek-v3 --layers 61 --tokens 16384 "${st[@]}" --host-sets contiguous,runs-64,runs-1
run fp8-packed_61 --spec deepseek-v3-fp8-packed --layers 61 --tokens 16384 "${st[@]}" --host-sets contiguous,runs-64,runs-1
run llama-3.1-8b_32 --spec llama-3.1-8b --layers 32 --tokens 16384 "${st[@]}" --host-sets contiguous,runs-64,runs-1
python3 bench/device/results.py combine "$OUT/$log.json" "${runs[@]}"
