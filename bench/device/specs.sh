#!/usr/bin/env bash
# Issue 21: `kvtier bench transfer` per spec, one JSON per spec (meta.spec set), every host and device set.
# SPECS (default glm-5,deepseek-v3,llama-3.1-8b,deepseek-v3-fp8-packed), VARIANTS (default planned,kernel),
# REPEATS (default 10), TAG (file name suffix). Then `page_first` contiguous loads of glm-5 and
# deepseek-v3 at page size 1 (one layer per call). Usage: bash bench/device/specs.sh
source bench/device/setup.sh
env_info > "$OUT/env_specs_${GPU}_$DATE${TAG:-}.txt" 2>&1
IFS=, read -r -a specs <<< "${SPECS:-glm-5,deepseek-v3,llama-3.1-8b,deepseek-v3-fp8-packed}"
for spec in "${specs[@]}"; do
  name="line_rate_${spec}_${GPU}_$DATE${TAG:-}"
  echo "== $spec" | tee -a "${LOG_DIR:-$OUT}/specs${TAG:-}.log"
  timeout "${SPEC_TIMEOUT:-150}" $KV bench transfer --spec "$spec" --variants "${VARIANTS:-planned,kernel}" \
    --repeats "${REPEATS:-10}" --json "$OUT/$name.json" "${SMOKE_TRANSFER[@]}" 2>&1 \
    | tee -a "${LOG_DIR:-$OUT}/specs${TAG:-}.log" | grep -E "│|ceiling" | grep -vE "^ *$"
done
if [ "${PAGE_FIRST:-glm-5}" != none ]; then
  IFS=, read -r -a pf <<< "${PAGE_FIRST:-glm-5}"
  for spec in "${pf[@]}"; do
    name="line_rate_page_first_${spec}_${GPU}_$DATE${TAG:-}"
    echo "== page_first $spec" | tee -a "${LOG_DIR:-$OUT}/specs${TAG:-}.log"
    timeout 120 $KV bench transfer --spec "$spec" --layout page_first --host-sets contiguous,runs-256,runs-64 \
      --variants "${VARIANTS:-planned,kernel}" --repeats "${REPEATS:-10}" --json "$OUT/$name.json" \
      "${SMOKE_TRANSFER[@]}" 2>&1 | tee -a "${LOG_DIR:-$OUT}/specs${TAG:-}.log" | grep -E "│|ceiling" | grep -vE "^ *$"
  done
fi
