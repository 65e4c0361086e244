#!/usr/bin/env bash
# One device call: environment, GPU tests, then `kvtier bench transfer` (deepseek-v3 bf16, 131072 tokens).
# Usage on the device machine: bash bench/device/transfer.sh [extra bench args]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import sortedcontainers, rich, hypothesis; print('deps ok')"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x tests -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.txt"
python3 -m kvtier.cli bench transfer --json "$OUT/transfer.json" "$@" 2>&1 | tee "$OUT/transfer.log"
