#!/usr/bin/env bash
# Issue 22: `kvtier bench transfer --gpus N`, every GPU of the host reloading at once, one process per
# GPU (each with its own pinned host pool on its GPU's NUMA node, its own device pool and ceiling). The
# planned load and backup, one layer of 131072 tokens per GPU, every host and device set; each rank alone
# (rank after rank) and all at once in the same run: `aggregate_ratio` is the aggregate over the mean
# one-GPU rate. Needs a machine of two GPUs or more (nvidia-h200-x2).
# GPUS (default: every GPU nvidia-smi lists; 1 under SMOKE=1), SPECS (default deepseek-v3,glm-5),
# REPEATS (default 10), TAG (file name suffix). Usage: bash bench/device/gpus.sh
source bench/device/setup.sh
if [ "${SMOKE:-0}" = 1 ]; then gpus=${GPUS:-1}; else gpus=${GPUS:-$(nvidia-smi -L | wc -l)}; fi
env="$OUT/env_gpus_${GPU}x${gpus}_$DATE${TAG:-}.txt"
env_info > "$env" 2>&1
nvidia-smi topo -m >> "$env" 2>&1  # each GPU's link to the others and its CPU and NUMA affinity
IFS=, read -r -a specs <<< "${SPECS:-deepseek-v3,glm-5}"
for spec in "${specs[@]}"; do
  name="line_rate_gpus_${spec}_${GPU}x${gpus}_$DATE${TAG:-}"
  timeout "${SPEC_TIMEOUT:-300}" $KV bench transfer --gpus "$gpus" --spec "$spec" --variants planned \
    --repeats "${REPEATS:-10}" --json "$OUT/$name.json" "${SMOKE_TRANSFER[@]}" 2>&1 | tee "$OUT/$name.log" \
    | grep -E "│|GPUs|wrote" | grep -vE "^ *$"
done
