#!/usr/bin/env bash
# Issue 43's engine figures on one GPU, one command (about 8 minutes):
#  1. correctness on CUDA: the paged kernels against attention over gathered rows, the engine's
#     paged path against the reference path, CUDA graphs against --enforce-eager (tiny GQA, MHA,
#     MLA, sliding-window and soft-capped models, greedy fp32), and the step's one synchronisation;
#  2. `bench/device/engine_bound.py`: Llama-3.1-8B shape, bf16, random weights: decode ms/step at
#     1, 16 and 64 running (512-token prompts) eager and with graphs, against the same run's copy
#     of the weights' bytes; prefill of a 2048-token piece against the same run's bf16 matmul rate;
#  3. `bench/device/engine_step_split.py`: a graph step split into host and replay (key `step_split`).
# Usage, from the repository root on the GPU machine: bash bench/device/engine.sh
# Env: TEST_TIMEOUT (default 240 s), BENCH_TIMEOUT (default 300 s), SPLIT_TIMEOUT (default 150 s).
source bench/device/setup.sh
env_info > "$OUT/env_engine_${GPU}_$DATE.txt" 2>&1
name=engine_${GPU}_$DATE
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider tests/test_paged.py \
  tests/test_engine_paged.py tests/test_engine.py 2>&1 | tee "$OUT/${name}_tests.log" | tail -5
timeout "${BENCH_TIMEOUT:-300}" python3 bench/device/engine_bound.py "$OUT/$name.json" 2>&1 \
  | tee "$OUT/$name.log" | grep -vE "^ *$"
timeout "${SPLIT_TIMEOUT:-150}" python3 bench/device/engine_step_split.py "$SCRATCH/split.json" 2>&1 \
  | tee "$OUT/${name}_split.log" | grep -E '^\{|weight'
python3 - "$OUT/$name.json" "$SCRATCH/split.json" <<'PY'
import json, sys
report, split = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
report["step_split"] = {k: v for k, v in split.items() if k != "meta"}
json.dump(report, open(sys.argv[1], "w"), indent=1)
PY
