#!/usr/bin/env bash
# Issue 21: are fully scattered rows bound by translating host addresses? The GPU tests of the
# planner, the executor and the cost model first (TESTS=0 skips them), then
# `bench/probes/probe_tlb.py` (host row orders and host memory kinds, `copy_rows` alone; MODE=span:
# the host span scattered rows lie in, against the kernel's programs).
# Usage: bash bench/device/tlb.sh
source bench/device/setup.sh
TAG=${TAG:-_tlb}
env_info > "$OUT/env_${GPU}_${DATE}${TAG}.txt" 2>&1
[ "${TESTS:-1}" = 1 ] && { timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py \
  tests/test_transfer.py tests/test_costs.py > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1
  tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"; }
timeout "${PROBE_TIMEOUT:-330}" python3 bench/probes/probe_tlb.py "$OUT/tlb_probe_${GPU}_${DATE}${TAG}.jsonl" "${MODE:-pages}" \
  > "$OUT/tlb_probe_${GPU}_${DATE}${TAG}.log" 2>&1
tail -4 "$OUT/tlb_probe_${GPU}_${DATE}${TAG}.log"
python3 - "$OUT/tlb_probe_${GPU}_${DATE}${TAG}.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "ratio" in r:
        print(*(r[k] for k in ("row_bytes", "memory", "huge_mb", "span_mb", "order", "direction", "sms", "ok", "ratio") if k in r))
    else:
        print(r)
PY
exit 0
