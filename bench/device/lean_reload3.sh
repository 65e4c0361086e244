#!/usr/bin/env bash
# Device call 3 of 2026-11-30 (fourth session): after the planner's options are checked once per
# cache (`Planner`) and the loop's arguments made lighter: GPU tests, the reload's stages (loop
# against table), the reload bench in four processes, and with the host copy in 8 and 64 runs.
source bench/device/setup.sh
python3 -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_cache.py tests/test_transfer.py \
  -k "cuda or native or tape or raw or signals or layers or loop" 2>&1 | tail -2 | tee "$R/pytest.txt"
python3 bench/device/probe_reload_stages.py "$R/stages.jsonl" 2>&1 | tail -4
reload_in_processes
for runs in 8 64; do
  python3 -m kvtier.cli bench cache --parts reload --reload-repeats 9 --reload-host-runs $runs \
    --json "$R/reload_runs$runs.json" 2>&1 | grep "│" | tail -1
done
tar czf "$OUT/call3.tgz" -C "$R" .
