#!/usr/bin/env bash
# One device call for the cache: its GPU tests, then the 128k-token deepseek-v3 reload through load_back
# at page sizes 1 and 16, then where the CPU time of one cold match + load_back goes (probe_full.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pytest -q tests/test_cache.py tests/test_transfer.py tests/test_engine.py -k "cuda or engine" \
  -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest.txt"
for ps in 1 16; do
  python3 -m kvtier.cli bench cache --parts reload --reload-repeats 7 --page-size $ps \
    --json "$OUT/cache_reload_page$ps.json" 2>&1 | tee "$OUT/cache_page$ps.log" | grep -v "^reload:" | tail -8
done
python3 bench/device/probe_full.py 2>&1 | tee "$OUT/probe_full.txt"
