#!/usr/bin/env bash
# Issue 19's H200 rows (README "Multi-turn"): `kvtier bench multiturn` with the Llama-3.1-8B shape
# (random bf16 weights: the real compute and 128 KiB of KV per token), kvtier, device-only and
# no-cache in one process, then `kvtier bench batching` on the same shape (6 requests at once
# against one by one; decode rate at 1, 8, 32 and 64 running). Under 9 minutes in all.
# Defaults: 16 clients x 5 rounds, each conversation 7168 tokens of context, then 256-token
# questions and 16-token answers, growing to 8528 tokens: a working set of 136448 tokens (16.7 GiB
# of KV), 4.2x the device KV budget of 32768 tokens (4 GiB); the host pool holds 163840 (20 GiB,
# pinned). Per configuration, device-only and no-cache prefill about 0.6M tokens (under a minute
# at 15-30k tokens/s: bench/FINDINGS.md, continuous batching), kvtier about 0.14M. The answer
# length sets what the cache can win: about 3 requests of 8k fit the device at once, so a
# request's share of the decode steps grows with OUTPUT while a miss's prefill does not (at
# OUTPUT=32 decoding weighs about as much as recomputing a prefix; OUTPUT=1 is SGLang's
# prefill-only setting).
# Usage, from the repository root on the GPU machine: bash bench/device/multiturn.sh [multiturn|batching|all]
# Env: CLIENTS, ROUNDS, CONTEXT, QUESTION, OUTPUT, DEVICE_TOKENS, HOST_TOKENS, RATE (rounds/s; default
# closed loop), MT_TIMEOUT (default 390 s), BATCH_TIMEOUT (default 150 s).
source bench/device/setup.sh
PART=${1:-all}
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
SHAPE=(--shape llama-3.1-8b --dtype bfloat16)
MT=(--clients "${CLIENTS:-16}" --rounds "${ROUNDS:-5}" --context-tokens "${CONTEXT:-7168}"
  --question-tokens "${QUESTION:-256}" --output-tokens "${OUTPUT:-16}"
  --device-tokens "${DEVICE_TOKENS:-32768}" --host-tokens "${HOST_TOKENS:-163840}")
[ -n "${RATE:-}" ] && MT+=(--request-rate "$RATE")
SMOKE_MT=() SMOKE_BATCH=()
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_MT=(--shape tiny --dtype auto --device cpu --clients 3 --rounds 3 --context-tokens 64
    --question-tokens 32 --output-tokens 4 --device-tokens 256 --host-tokens 4096)
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
