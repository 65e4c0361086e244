#!/usr/bin/env bash
# Device call 1 of 2026-11-30 (third session): the compiled submission loop (kvtier/transfer/native.py)
# and int32 ids. GPU tests of transfers, cache and the loop; the 128k-token reload's CPU cost at pages
# 1 and 16 with int32 and int64 ids, and with the loop turned off (KVTIER_NATIVE=0); its profile;
# then the overlap bench with nvidia-smi clock and power samples per interference round.
# Call 2: the same without the overlap bench (OVERLAP=0), after the copy table (rows of every layer
# built at once). Call 3: the same after ordering the load from the tape, 15 repeats (REPEATS), and
# prefixes whose host copy lies in 8 and 64 runs (HOST_RUNS). CALL names the archive.
source bench/device/setup.sh
CALL=${CALL:-call1}
cc --version | head -1 | tee -a "$R/env.txt"
python3 -m pytest -q tests/test_native.py tests/test_cache.py tests/test_transfer.py \
  -k "cuda or native or tape or raw" -p no:cacheprovider 2>&1 | tail -3 | tee "$R/pytest.txt"
reload() {  # name, then extra arguments
  local name=$1; shift
  python3 -m kvtier.cli bench cache --parts reload --reload-repeats "${REPEATS:-9}" "$@" \
    --json "$R/reload_$name.json" 2>&1 | grep -v "^reload:" | tail -4
}
for ps in 1 16; do
  for ids in int32 int64; do reload "page${ps}_$ids" --page-size $ps --reload-ids $ids; done
done
for runs in ${HOST_RUNS:-}; do reload "page1_int32_runs$runs" --page-size 1 --reload-host-runs "$runs"; done
KVTIER_NATIVE=0 reload page1_int32_python --page-size 1 --reload-ids int32
python3 bench/device/probe_reload_cpu.py 2>&1 | tee "$R/reload_cpu_profile.txt"
if [ "${OVERLAP:-1}" = 1 ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
    --format=csv,noheader -lms 50 > "$R/smi.csv" &
  smi=$!
  python3 -m kvtier.cli bench overlap --rounds 5 --rounds-log "$R/rounds.jsonl" --json "$R/overlap.json" \
    2>&1 | grep -v "^\[" | tail -12
  kill $smi
  python3 bench/device/smi_by_phase.py "$R/smi.csv" "$R/rounds.jsonl" | tee "$R/rounds_clock.txt"
fi
tar czf "$OUT/$CALL.tgz" -C "$R" .
