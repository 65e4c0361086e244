#!/usr/bin/env bash
# README "Served TTFT": `kvtier bench served`, prefixes 8k-128k, kvtier and stock, in one process.
# SETUPS=smollm2,deepseek-v3 (the default, ~4 minutes) -> served_$GPU_$DATE.{json,log};
# SETUPS=glm-5 (78 layers of MLA + the DSA indexer: 13.1 GB of KV at 128k, a 52.6 GB pinned host
# pool; to be measured, alone in its call) -> served_glm-5_$GPU_$DATE.{json,log}.
# Usage, from the repository root on the GPU machine: [SETUPS=glm-5] bash bench/device/served.sh
source bench/device/setup.sh
SETUPS=${SETUPS:-smollm2,deepseek-v3}
name=served_${GPU}_$DATE
[ "$SETUPS" = smollm2,deepseek-v3 ] || name=served_${SETUPS//,/-}_${GPU}_$DATE
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
table_served "$name" 600 "$SETUPS"
