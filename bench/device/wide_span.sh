#!/usr/bin/env bash
# Issue 21: kernel launches over a wide host span (`launch.WIDE_SPAN_BYTES`). On one lease:
# `probe_tlb.py span` (scattered rows of 1152 and 2048 bytes drawn from 1x-8x the rows, 2-8
# programs), then per spec the planned loads and backups from a host pool of HOST_SLOTS (default
# 1048576: ~1.1-2.1 GiB per layer) with the wide grids and without them (WIDE_SPAN_BYTES out of
# reach), in turn, one process each. TAG names the files (default _wide); PROBE=0 skips the probe.
# Usage: bash bench/device/wide_span.sh
source bench/device/setup.sh
TAG=${TAG:-_wide}
env_info > "$OUT/env_${GPU}_${DATE}${TAG}.txt" 2>&1
if [ "${PROBE:-1}" = 1 ]; then
  timeout 240 python3 bench/probes/probe_tlb.py "$SCRATCH/span.jsonl" span > "$SCRATCH/span.log" 2>&1 \
    || tail -3 "$SCRATCH/span.log"
  cp "$SCRATCH/span.jsonl" "$OUT/tlb_probe_${GPU}_${DATE}${TAG}_span.jsonl"
  python3 - "$SCRATCH/span.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"ratio"' in line]
table = collections.defaultdict(dict)
for r in rows:
    table[(r["row_bytes"], r["order"], r["direction"], r["span_mb"])][r["sms"]] = (r["ratio"], r["ok"])
for key, by_sms in table.items():
    print(*key, " ".join(f"{s}:{v[0]}{'' if v[1] else '!'}" for s, v in sorted(by_sms.items())))
PY
fi

# `kvtier` with no launch wide: the lean grids whatever the host span.
NARROW=(python3 -c "import sys
from kvtier.transfer import launch
launch.WIDE_SPAN_BYTES = 1 << 62
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))")
runs=()
for spec in ${SPECS:-glm-5 deepseek-v3 llama-3.1-8b}; do
  for grid in wide narrow; do
    cmd=($KV)
    [ "$grid" = narrow ] && cmd=("${NARROW[@]}")
    timeout 110 "${cmd[@]}" bench transfer --spec "$spec" --variants planned --host-sets "${SETS:-runs-1,runs-16,runs-64}" \
      --host-slots "${HOST_SLOTS:-1048576}" --repeats 10 --json "$SCRATCH/${spec}_$grid.json" "${SMOKE_TRANSFER[@]}" \
      > "$SCRATCH/$spec.log" 2>&1 || tail -3 "$SCRATCH/$spec.log"
    python3 -c "import json; d = json.load(open('$SCRATCH/${spec}_$grid.json'))
print('$spec $grid', ' '.join(f\"{r['direction'][0]}:{r['host_runs']}/{r['device'][:4]}={r['ceiling_ratio']}({r['sms']})\" for r in d['rows']))"
    runs+=("${spec}_$grid=$SCRATCH/${spec}_$grid.json")
  done
done
python3 bench/device/results.py combine "$OUT/wide_span_ab_${GPU}_$DATE$TAG.json" "${runs[@]}"
exit 0
