#!/usr/bin/env bash
# Issue 18's GPU rows: `kvtier bench storage` on the H200 with the DeepSeek-V3 shape over the file
# backend on the machine's local disk (/tmp). `ttft`: TTFT of a storage hit (a new engine over the
# store, as after a restart) beside a host hit and a miss for prefixes of 2k-128k tokens, with the
# storage read against the raw read rate of the same run, for each host layout (LAYOUTS; the engine
# stores a value per 64-token page). `io`: page put/get throughput beside raw files (and
# Redis where redis-server is installed) and compression of random-weight KV (no weights there; ~3
# minutes). Each part fits one device call: run them in two calls.
# Usage, from the repository root on the GPU machine: bash bench/device/storage.sh ttft|io|all
# Env: STORAGE_TOKENS (default 2048,8192,32768,65536), LAYOUTS, STORE (default /tmp/kvtier-bench-storage).
source bench/device/setup.sh
PART=${1:-all}
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
# The storage tier imports xxhash (and lz4, zstandard to compress); nothing installs there.
python3 -c "import xxhash" || { echo "storage.sh: python3 lacks xxhash, which kvtier.storage needs"; exit 3; }
STORE=${STORE:-/tmp/kvtier-bench-storage}
TOKENS=${STORAGE_TOKENS:-2048,8192,32768,65536}
BACKENDS=file
command -v redis-server > /dev/null && BACKENDS=file,redis
SMOKE_STORAGE=()
[ "${SMOKE:-0}" = 1 ] && SMOKE_STORAGE=(--device cpu --quick --tokens 256)
mkdir -p "$STORE"
df -h "$STORE" >> "$OUT/env_${GPU}_$DATE.txt" 2>&1
if [ "$PART" = ttft ] || [ "$PART" = all ]; then
  for layout in ${LAYOUTS:-layer_first page_first}; do
    name=storage_ttft_${layout}_${GPU}_$DATE
    timeout 270 $KV bench storage --parts ttft --setup deepseek-v3 --tokens "$TOKENS" --miss-repeats 3 \
      --layout "$layout" --dir "$STORE" --json "$OUT/$name.json" "${SMOKE_STORAGE[@]}" 2>&1 \
      | tee "$OUT/$name.log" | grep -vE "^ *$"
  done
fi
if [ "$PART" = io ] || [ "$PART" = all ]; then
  name=storage_io_${GPU}_$DATE
  timeout 540 $KV bench storage --parts throughput,compression --backends "$BACKENDS" --dir "$STORE" \
    --json "$OUT/$name.json" "${SMOKE_STORAGE[@]}" 2>&1 | tee "$OUT/$name.log" | grep -vE "^ *$"
fi
rm -rf "$STORE"
