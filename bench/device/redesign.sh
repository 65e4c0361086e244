#!/usr/bin/env bash
# Issue 17's re-measurement after the redesign, in one device call (`run`, 600 s at most):
#   (i)   the line-rate table: `kvtier bench transfer`, deepseek-v3 bf16, as the README's table;
#   (ii)  the cache reload: `kvtier bench cache --parts reload`, six processes;
#   (iii) the served benchmark, both setups in one process: `kvtier bench served --setups
#         smollm2,deepseek-v3 --prefix 8192,32768,131072 --repeats 3`;
# then a summary against the committed figures (every planned row within 0.01 of its value).
#
# Sized from the committed runs' timestamps: (i) with 10 repeats took ~40 s (its JSON's date,
# 2026-11-30_s7, 40 s after the overlap run before it); (ii) ~13 s per process of 15 repeats
# (cache_reload_h200_2026-11-30_s4.json's dates), ~85 s for six; (iii) finished within 3 min 45 s
# of committing the code it ran (served_h200_2026-11-29.json), most of it the stock
# configuration's per-token backups at 128k. Expected ~6.5 minutes. Each stage has a timeout and
# (iii) gets what is left of DEADLINE (default 570 s), so the summary is always printed.
#
# Files under $OUT (8 at most come back from the device):
#   redesign_$GPU_$DATE.txt       the machine, versions, each stage's exit status and seconds, the summary
#   line_rate_transfer_$GPU_$DATE.{json,log}, cache_reload_$GPU_$DATE.{json,log}, served_$GPU_$DATE.{json,log}
# Usage, from the repository root on the GPU machine: bash bench/device/redesign.sh
# (SMOKE=1 on a CPU machine runs the same commands at toy sizes, to check them without a GPU.)
source bench/device/setup.sh
DEADLINE=${DEADLINE:-570}
report="$OUT/redesign_${GPU}_$DATE.txt"
env_info > "$report" 2>&1
cat "$report"

stage() {  # name, exit status, start second
  echo "stage $1: exit $2, $((SECONDS - $3)) s" | tee -a "$report"
}

t=$SECONDS
table_transfer "line_rate_transfer_${GPU}_$DATE" 180
stage "(i) bench transfer" $? $t

t=$SECONDS
table_cache_reload "cache_reload_${GPU}_$DATE" 60
stage "(ii) bench cache --parts reload" $? $t

t=$SECONDS
left=$((DEADLINE - SECONDS - 15))
table_served "served_${GPU}_$DATE" $((left > 60 ? left : 60))
stage "(iii) bench served (timeout ${left} s)" $? $t

python3 bench/device/results.py summary --transfer "$OUT/line_rate_transfer_${GPU}_$DATE.json" \
  --cache "$OUT/cache_reload_${GPU}_$DATE.json" --served "$OUT/served_${GPU}_$DATE.json" \
  --committed bench/results 2>&1 | tee -a "$report"
echo "total: $SECONDS s" | tee -a "$report"
