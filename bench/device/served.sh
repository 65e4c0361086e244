#!/usr/bin/env bash
# One device call for the served benchmark: GPU tests of the engine, then `kvtier bench served`
# (SmolLM2-shaped and DeepSeek-V3-shaped random-weight models, kvtier vs stock, 8k-128k prefixes).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q tests/test_engine.py -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/pytest.txt"
python3 -m kvtier.cli bench served --prefix 8192,32768,131072 --repeats 3 --json "$OUT/served.json" 2>&1 \
  | tee "$OUT/served.log" | tail -30
