#!/usr/bin/env bash
# One device call for the served benchmark: `kvtier bench served` for the setups and prefixes given
# (default: both setups, 8k-128k), JSON and log under $OUT. Usage: served.sh [SETUPS] [PREFIXES] [TAG]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SETUPS=${1:-smollm2,deepseek-v3}; PREFIXES=${2:-8192,32768,131072}; TAG=${3:-served}
python3 -m kvtier.cli bench served --setups "$SETUPS" --prefix "$PREFIXES" --repeats 3 \
  --json "$OUT/$TAG.json" 2>&1 | tee "$OUT/$TAG.log" | tail -30
