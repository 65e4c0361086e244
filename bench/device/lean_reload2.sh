#!/usr/bin/env bash
# Device call 2 of 2026-11-30 (fourth session): what the reload's runtime calls cost from C (runtime
# against driver API, event records against progress words); the reload's stages again with a
# third form whose thread was busy before the call; the reload bench in four processes.
source bench/device/setup.sh
python3 bench/device/probe_driver_calls.py "$R/driver_calls.jsonl" 2>&1 | tail -6
python3 bench/device/probe_reload_stages.py "$R/stages.jsonl" 2>&1 | tail -6
reload_in_processes
tar czf "$OUT/call2.tgz" -C "$R" .
