#!/usr/bin/env bash
# README "Line rate at every fragmentation": `kvtier bench transfer`, deepseek-v3 bf16 (~1 minute).
# Usage, from the repository root on the GPU machine: bash bench/device/transfer.sh
source bench/device/setup.sh
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
table_transfer "line_rate_transfer_${GPU}_$DATE"
