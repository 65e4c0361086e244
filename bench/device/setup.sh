# Sourced by every script in bench/device/ (run them from the repository root on the GPU machine).
#
# - kvtier is imported from the working tree (PYTHONPATH): nothing installs on that machine, whose
#   python3 has torch, triton, transformers and numpy; `python3 -m kvtier` is the `kvtier` command.
# - What comes back is what the scripts write under $OUT (at most 8 files: scratch goes to $SCRATCH).
# - Results are named TABLE_$GPU_$DATE.json with the table's log beside them, as in bench/results/.
# - SMOKE=1 runs the same commands on a CPU machine at toy sizes (flags and file names only).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
SCRATCH=$(mktemp -d)
GPU=${GPU:-h200}
DATE=${DATE:-$(date -u +%F)}
KV="python3 -m kvtier"
mkdir -p "$OUT"

# Extra arguments per benchmark in SMOKE mode (argparse takes the last of a repeated flag).
SMOKE_TRANSFER=() SMOKE_CACHE=() SMOKE_SERVED=()
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_TRANSFER=(--device cpu --tokens 1024 --repeats 1 --warmup 0)
  SMOKE_CACHE=(--device cpu --reload-tokens 1024 --reload-repeats 2)
  SMOKE_SERVED=(--device cpu --layers 2 --prefix 256 --repeats 1 --cycles 1)
fi

env_info() {  # the GPU, its link and driver, the versions, the host's cores and memory
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 \
    || echo "no nvidia-smi"
  python3 - <<'PY'
import platform, torch
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "none"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", tv)
PY
  echo "cpus $(nproc)"; grep -E 'MemTotal|MemAvailable' /proc/meminfo
}

# The transfer table (README "Transfer"): deepseek-v3 bf16, one layer of 131072 tokens, every
# host and device set, the planned path, the kernel forced and the stock kernel, 10 repeats.
# Usage: table_transfer NAME [timeout seconds] -> $OUT/NAME.json, $OUT/NAME.log
table_transfer() {
  timeout "${2:-300}" $KV bench transfer --variants planned,kernel,stock --repeats 10 \
    --json "$OUT/$1.json" "${SMOKE_TRANSFER[@]}" 2>&1 | tee "$OUT/$1.log" | grep -E "│|ceiling|wrote"
}

# The cache reload (README "Cache reload and CPU cost"), as in
# cache_reload_h200_2026-12-01.json: `kvtier bench cache --parts reload`, a 131072-token
# deepseek-v3 prefix, 15 repeats per process, pages 1 and 16 in two processes each (the host's
# speed differs by process), then the host copy in 8 and 64 runs. One JSON keyed by process.
# Usage: table_cache_reload NAME [timeout seconds per process]
table_cache_reload() {
  local name=$1 t=${2:-90} runs=() p
  for p in page1_proc1:"--page-size 1" page16_proc1:"--page-size 16" page1_proc2:"--page-size 1" \
    page16_proc2:"--page-size 16" page1_host_runs8:"--reload-host-runs 8 --reload-repeats 9" \
    page1_host_runs64:"--reload-host-runs 64 --reload-repeats 9"; do
    local key=${p%%:*} args=${p#*:}
    echo "== $key: $args" | tee -a "$OUT/$name.log"
    # shellcheck disable=SC2086  # $args holds several flags
    timeout "$t" $KV bench cache --parts reload --reload-repeats 15 $args --json "$SCRATCH/$key.json" \
      "${SMOKE_CACHE[@]}" 2>&1 | tee -a "$OUT/$name.log" | grep -E "│" | tail -1
    runs+=("$key=$SCRATCH/$key.json")
  done
  python3 bench/device/results.py combine "$OUT/$name.json" "${runs[@]}"
}

# The served benchmark (README "Served TTFT"), as committed in served_h200_2026-12-01.json: the
# setups in one process (default smollm2,deepseek-v3; glm-5 goes in its own call, see served.sh),
# prefixes 8k-128k, kvtier and stock, 4 fill/evict cycles, median of 3.
# Usage: table_served NAME [timeout seconds] [setups]
table_served() {
  timeout "${2:-600}" $KV bench served --setups "${3:-smollm2,deepseek-v3}" --prefix 8192,32768,131072 \
    --repeats 3 --json "$OUT/$1.json" "${SMOKE_SERVED[@]}" 2>&1 | tee "$OUT/$1.log" | grep -vE "^ *$"
}
