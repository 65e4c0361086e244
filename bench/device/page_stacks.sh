#!/usr/bin/env bash
# Issue 21, `page_first` fully scattered pages (host runs of 1, every layer in one call): the layer-group
# kernel against stacks through the copy engine, all buffers or only pages of 32 KiB and more
# (`probe_page_stacks.py`). SPECS: `spec:layers` items (default: the probe's four). Usage:
# bash bench/device/page_stacks.sh
source bench/device/setup.sh
env_info > "$OUT/env_page_stacks_${GPU}_$DATE.txt" 2>&1
timeout "${RUN_TIMEOUT:-420}" python3 bench/probes/probe_page_stacks.py "$OUT/page_stacks_probe_${GPU}_$DATE.jsonl" \
  ${SPECS:-} 2>&1 | tee "$OUT/page_stacks_probe_${GPU}_$DATE.log" | grep -vE "^ *$"
