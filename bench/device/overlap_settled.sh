#!/usr/bin/env bash
# Device calls 6-8 of 2026-11-30 (fourth session): `kvtier bench overlap` with the warm-up that runs
# matmuls alone until their rate settles (30-150 s) before the measured rounds; call 7 also times
# each round only after 3 s in its own conditions; call 8 issues the reloads interleaved with the
# matmuls, sized at the ceiling to cover the timed window.
source bench/device/setup.sh
python3 -m kvtier.cli bench overlap --rounds 5 --json "$R/overlap.json" --rounds-log "$R/rounds.jsonl" \
  2>&1 | grep -v "^ *$" | tail -14
tar czf "$OUT/call${CALL:-6}.tgz" -C "$R" .
