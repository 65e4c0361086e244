#!/usr/bin/env bash
# Issue 21, staged parts with their buffers apart in both directions: the GPU tests of the planner and
# the executor, then `probe_stage_apart.py` (`glm-5`, loads and backups onto scattered slots, the
# buffers apart against one after the other, ROUNDS in the probe, each plan byte-checked), with a
# profiled layer per direction. TAG names the files (default _backup_apart). Usage:
# bash bench/device/backup_apart.sh
source bench/device/setup.sh
TAG=${TAG:-_backup_apart}
env_info > "$OUT/env_${GPU}_$DATE$TAG.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_splits.py tests/test_transfer.py \
  > "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log" 2>&1; tail -2 "$OUT/gpu_tests_${GPU}_${DATE}${TAG}.log"
timeout "${RUN_TIMEOUT:-300}" python3 bench/probes/probe_stage_apart.py "$OUT/stage_apart_probe_${GPU}_$DATE$TAG.jsonl" \
  ${SPECS:-} 2>&1 | tee "$OUT/stage_apart_probe_${GPU}_$DATE$TAG.log" | grep -vE "^ *$" | cut -c1-400
