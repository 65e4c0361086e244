#!/usr/bin/env bash
# One device call for the cache: its GPU tests, then the 128k-token deepseek-v3 reload through load_back.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q tests/test_cache.py tests/test_transfer.py -k "cuda" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest.txt"
python3 -m kvtier.cli bench cache --parts reload --reload-repeats 5 --json "$OUT/cache_reload.json" 2>&1 | tee "$OUT/cache.log" | tail -30
