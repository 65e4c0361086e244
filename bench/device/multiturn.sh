#!/usr/bin/env bash
# Issue 19's H200 rows (README "Multi-turn") and issue 43's: `kvtier bench multiturn` with the
# Llama-3.1-8B shape (random bf16 weights: the real compute and 128 KiB of KV per token), kvtier,
# device-only and no-cache in one process, then `kvtier bench batching` on the same shape (6
# requests at once against one by one; decode rate at 1, 8, 32 and 64 running).
# Defaults (the README's first table): 16 clients x 10 rounds, each conversation 7168 tokens of
# context, then 256-token questions and 1-token answers (SGLang's benchmark default: the
# prefill-bound case), growing to 9738 tokens: a working set of 155808 tokens (20.4 GB of KV),
# 4.75x the device KV budget of 32768 tokens (4.3 GB); the host pool holds 163840 (21.5 GB,
# pinned). The README's second table: GPU=h200_o16 OUTPUT=16 ROUNDS=5.
# Issue 43's shape (12 clients x 6 rounds, 6144 of context, 384-token questions, a device budget of
# 24576 tokens: 4.27x with 48-token answers), one table per answer length, each repeated with the
# configurations' order rotated (the headline compares warm rounds, round >= 2; cold apart):
#   CLIENTS=12 ROUNDS=6 CONTEXT=6144 QUESTION=384 OUTPUT=1,48 DEVICE_TOKENS=24576 REPEATS=3 \
#     MT_TIMEOUT=580 bash bench/device/multiturn.sh multiturn
# (one command may run 600 s at most: time REPEATS=1 first, then choose REPEATS to fit).
# A trace instead of the synthetic conversations: TRACE=bench/traces/multiturn_example.csv.
# Usage, from the repository root on the GPU machine: bash bench/device/multiturn.sh [multiturn|batching|all]
# Env: CLIENTS, ROUNDS, CONTEXT, QUESTION, OUTPUT (a comma list: a table each), DEVICE_TOKENS,
# HOST_TOKENS, RATE (rounds/s; default closed loop), REPEATS (default 1), ORDER (fixed, alternate,
# rotate, shuffle; default rotate), CONFIGS (default all three), TRACE, MT_TIMEOUT (default 390 s),
# BATCH_TIMEOUT (default 150 s). Each table's untimed kvtier run comes first (`--no-warm-run`).
source bench/device/setup.sh
PART=${1:-all}
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
SHAPE=(--shape llama-3.1-8b --dtype bfloat16)
MT=(--device-tokens "${DEVICE_TOKENS:-32768}" --host-tokens "${HOST_TOKENS:-163840}"
  --repeats "${REPEATS:-1}" --order "${ORDER:-rotate}")
if [ -n "${TRACE:-}" ]; then
  MT+=(--trace "$TRACE")
else
  MT+=(--clients "${CLIENTS:-16}" --rounds "${ROUNDS:-10}" --context-tokens "${CONTEXT:-7168}"
    --question-tokens "${QUESTION:-256}" --output-tokens "${OUTPUT:-1}")
  [ -n "${RATE:-}" ] && MT+=(--request-rate "$RATE")
fi
[ -n "${CONFIGS:-}" ] && MT+=(--configs "$CONFIGS")
SMOKE_MT=() SMOKE_BATCH=()
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_MT=(--shape tiny --dtype auto --device cpu --device-tokens 1024 --host-tokens 4096)
  [ -z "${TRACE:-}" ] && SMOKE_MT+=(--clients 3 --rounds 3 --context-tokens 64 --question-tokens 32
    --output-tokens "${OUTPUT:-4}" --device-tokens 256)
  SMOKE_BATCH=(--shape tiny --dtype auto --device cpu --running 1,8 --steps 4)
fi
# matplotlib may be missing there (nothing installs): then plot from the JSON elsewhere with
# `kvtier bench multiturn --from-json FILE --plot FILE.png`.
PLOT=()
python3 -c "import matplotlib" 2> /dev/null && PLOT=(--plot "$OUT/multiturn_${GPU}_$DATE.png")
if [ "$PART" = multiturn ] || [ "$PART" = all ]; then
  name=multiturn_${GPU}_$DATE
  timeout "${MT_TIMEOUT:-390}" $KV bench multiturn "${SHAPE[@]}" "${MT[@]}" --json "$OUT/$name.json" \
    "${PLOT[@]}" "${SMOKE_MT[@]}" 2>&1 | tee "$OUT/$name.log" | grep -vE "^ *$"
fi
if [ "$PART" = batching ] || [ "$PART" = all ]; then
  name=batching_${GPU}_$DATE
  timeout "${BATCH_TIMEOUT:-150}" $KV bench batching "${SHAPE[@]}" --running 1,8,32,64 \
    --json "$OUT/$name.json" "${SMOKE_BATCH[@]}" 2>&1 | tee "$OUT/$name.log" | grep -vE "^ *$"
fi
