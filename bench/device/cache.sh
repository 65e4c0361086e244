#!/usr/bin/env bash
# bench/RESULTS.md "Cache reload": `kvtier bench cache --parts reload`, deepseek-v3 (61 layers), a prefix
# of 8192 and of 131072 tokens in 1, 8, 64 and 512 host runs, one process each (~3 minutes on an H100).
# First the CUDA tests of what a reload runs (the compiled loop, the transfer paths, the cache, the vLLM
# connector's row-kernel moves): $OUT/cache_tests.log. Writes $OUT/cache_reload.jsonl (one JSON
# per process) and cache_reload.log. TESTS=0 skips the tests.
# Usage, from the repository root on the GPU machine: bash bench/device/cache.sh
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
SCRATCH=$(mktemp -d)
mkdir -p "$OUT"
EXTRA=()
SIZES=${SIZES:-8192 131072}
[ "${SMOKE:-0}" = 1 ] && EXTRA=(--device cpu) && SIZES=1024
if [ "${SMOKE:-0}" != 1 ] && [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider tests/test_native.py \
    tests/test_vllm_parts.py tests/test_transfer.py tests/test_cache.py > "$OUT/cache_tests.log" 2>&1
  tail -3 "$OUT/cache_tests.log"
fi
: > "$OUT/cache_reload.jsonl"
for tokens in $SIZES; do
  for runs in 1 8 64 512; do
    timeout 120 python3 -m kvtier bench cache --parts reload --reload-tokens "$tokens" --reload-host-runs "$runs" \
      --reload-repeats 10 --json "$SCRATCH/r.json" "${EXTRA[@]}" >> "$OUT/cache_reload.log" 2>&1
    echo "tokens $tokens runs $runs rc=$?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d))" "$SCRATCH/r.json" >> "$OUT/cache_reload.jsonl"
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); r=d['reload'] if 'reload' in d else d
r = r[0] if isinstance(r, list) else r
print({k: r.get(k) for k in ('tokens','host_runs','cpu_us','thread_us','match_us','reload_ms','ideal_ms','ratio')})" "$SCRATCH/r.json"
  done
done
