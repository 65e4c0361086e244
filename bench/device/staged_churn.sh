#!/usr/bin/env bash
# Device call 1 of 2026-11-30 (second session): GPU tests of kernels, transfers, cache and engine; the
# staged path with batched DMA on churned host runs onto scattered device slots (load and backup); the
# 128k-token reload's CPU cost through match + load_back; packed fp8 rows with padded host strides
# (C probe); the matmul's loss beside the kernel by load-stream priority and SM budget.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; lscpu | grep "Model name"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py tests/test_cache.py tests/test_engine.py \
  -k "kernel or cuda or engine" -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest.txt"
b="python3 -m kvtier.cli bench"
$b transfer --host-sets contiguous,runs-256,runs-64,contiguous-churn,first_fit-churn --device-sets contiguous,scattered \
  --variants planned,kernel --json "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.log" | tail -30
for ps in 1 16; do
  $b cache --parts reload --reload-repeats 7 --page-size $ps --json "$OUT/cache_reload_page$ps.json" 2>&1 \
    | tee "$OUT/cache_page$ps.log" | grep -v "^reload:" | tail -6
done
nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o /tmp/probe bench/device/probe_pcie.cu
for stride in 656 672 704 768; do
  /tmp/probe 656 vec 1 $stride >> "$OUT/pcie_probe_fp8_stride.jsonl"
done
python3 - "$OUT/pcie_probe_fp8_stride.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if r.get("variant", "").startswith("vec"):
        print(r["variant"], r["stride"], r["ctas"], r["threads"], r["of_ceiling"], r["identical"])
PY
python3 bench/device/probe_priority.py 2>&1 | tee "$OUT/priority.jsonl"
