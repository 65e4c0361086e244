#!/usr/bin/env bash
# Where glm-5's time goes on the sets below its goal: the same sets (same seed, so the same slots)
# for glm-5, its indexer alone (glm-5-indexer) and its latent alone (deepseek-v3: 1152-byte rows),
# planned, staged and kernel; one JSON keyed by spec. PART_SETS (default first_fit-churn,runs-16).
# Usage: bash bench/device/parts.sh
source bench/device/setup.sh
for spec in glm-5 glm-5-indexer deepseek-v3; do
  timeout "${SPEC_TIMEOUT:-90}" $KV bench transfer --spec "$spec" --variants planned,staged,kernel \
    --host-sets "${PART_SETS:-first_fit-churn,runs-16}" --device-sets scattered --repeats 10 \
    --json "$SCRATCH/parts_$spec.json" "${SMOKE_TRANSFER[@]}" > "$SCRATCH/parts.log" 2>&1 || tail -3 "$SCRATCH/parts.log"
  python3 -c "import json; d = json.load(open('$SCRATCH/parts_$spec.json'))
print('$spec', ' '.join(f\"{r['direction'][0]}:{r['host_runs']}/{r['variant']}={r['gbps']}\" for r in d['rows']))"
done
python3 bench/device/results.py combine "$OUT/parts_${GPU}_$DATE.json" \
  $(for f in "$SCRATCH"/parts_*.json; do echo "$(basename "$f" .json)=$f"; done)
