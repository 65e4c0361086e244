#!/usr/bin/env bash
# One device call for the line-rate work: GPU tests, the full transfer table, small
# rows (packed fp8 MLA, DSA indexer at page 1 and 16), duplex and interference.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/line_rate.log"
{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  python3 -c "import torch; torch.cuda.init(); torch.empty(1, device='cuda'); from kvtier.transfer import dma; print('dma mode', dma.dma_mode().value, 'direct batch', dma._direct_batch() is not None)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x tests/test_kernels.py tests/test_transfer.py -k "kernel or cuda" -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pytest.txt"
k=python3; b="-m kvtier.cli bench"
$k $b transfer --kernel-sweep 4x112,8x28,16x28 --json "$OUT/transfer.json" 2>&1 | tee -a "$log" | tail -120
$k $b transfer --spec deepseek-v3-fp8-packed --host-sets runs-1 --device-sets scattered --variants planned,kernel,stock \
  --kernel-sweep 8x50,16x50,8x128 --json "$OUT/fp8.json" 2>&1 | tee -a "$log" | tail -16
$k $b transfer --spec glm-5-indexer --host-sets runs-1 --device-sets scattered --variants planned,kernel,stock \
  --kernel-sweep 8x128,16x128,8x496 --json "$OUT/indexer1.json" 2>&1 | tee -a "$log" | tail -20
$k $b transfer --spec glm-5-indexer --page-size 16 --host-sets runs-16,runs-64 --device-sets scattered \
  --variants planned,kernel,stock,batched_dma --kernel-sweep 8x16,16x31 --json "$OUT/indexer16.json" 2>&1 | tee -a "$log" | tail -16
$k $b overlap --json "$OUT/overlap.json" 2>&1 | tee -a "$log" | tail -12
