#!/usr/bin/env bash
# README "Served TTFT": `kvtier bench served`, both setups in one process, prefixes 8k-128k (~4 minutes).
# Usage, from the repository root on the GPU machine: bash bench/device/served.sh
source bench/device/setup.sh
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
table_served "served_${GPU}_$DATE"
