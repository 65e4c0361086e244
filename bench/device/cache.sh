#!/usr/bin/env bash
# README "Cache reload and CPU cost": `kvtier bench cache --parts reload` in six processes (~2 minutes).
# Usage, from the repository root on the GPU machine: bash bench/device/cache.sh
source bench/device/setup.sh
env_info > "$OUT/env_${GPU}_$DATE.txt" 2>&1
table_cache_reload "cache_reload_${GPU}_$DATE"
