#!/usr/bin/env bash
# README "Small rows and layer groups" (~5 minutes), as committed in line_rate_small_h200_2026-11-30_s7.json
# and line_rate_groups_h200_2026-11-30_s6.json: fully scattered rows one layer per call (`layer_first`), then
# `page_first` at page size 1 one layer per call against several layers per call. One JSON per table,
# keyed by run. Usage, from the repository root on the GPU machine: bash bench/device/small_rows.sh
source bench/device/setup.sh
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
run() {  # key, then bench transfer arguments
  local key=$1; shift
  echo "== $key: $*" | tee -a "$OUT/$log.log"
  timeout 120 $KV bench transfer --host-sets runs-1 --device-sets scattered --variants planned --repeats 10 \
    "$@" --json "$SCRATCH/$key.json" "${SMOKE_TRANSFER[@]}" 2>&1 | tee -a "$OUT/$log.log" | grep "│" | tail -2
  runs+=("$key=$SCRATCH/$key.json")
}
log=line_rate_small_${GPU}_$DATE runs=()
run deepseek-v3-fp8-packed --spec deepseek-v3-fp8-packed
run glm-5-indexer --spec glm-5-indexer
run glm-5-indexer-page16 --spec glm-5-indexer --page-size 16
run llama-3.1-8b --spec llama-3.1-8b
python3 bench/device/results.py combine "$OUT/$log.json" "${runs[@]}"
log=line_rate_groups_${GPU}_$DATE runs=()
g=(--layout page_first)
run idx1 "${g[@]}" --spec glm-5-indexer --layers 1
run idx16 "${g[@]}" --spec glm-5-indexer --layers 16
run idx32 "${g[@]}" --spec glm-5-indexer --layers 32
run idx78 "${g[@]}" --spec glm-5-indexer --layers 78 --tokens 65536
run fp8_1 "${g[@]}" --spec deepseek-v3-fp8-packed --layers 1
run fp8_8 "${g[@]}" --spec deepseek-v3-fp8-packed --layers 8
run glm5_1 "${g[@]}" --spec glm-5 --layers 1 --tokens 65536
run glm5_8 "${g[@]}" --spec glm-5 --layers 8 --tokens 65536
python3 bench/device/results.py combine "$OUT/$log.json" "${runs[@]}"
