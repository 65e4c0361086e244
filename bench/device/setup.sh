# Sourced by the device call scripts: strict pipes, the repository on the path, a scratch
# folder R for results (archived into $OUT at the end), and the GPU and versions in R/env.txt.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p "$OUT" "$R"
{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$R/env.txt"
# The 128k-token reload's CPU cost at pages 1 and 16, in two processes each (they differ by process).
reload_in_processes() {
  for i in 1 2; do
    for ps in 1 16; do
      python3 -m kvtier.cli bench cache --parts reload --reload-repeats 15 --page-size $ps \
        --json "$R/reload_page${ps}_proc$i.json" 2>&1 | grep "│" | tail -1
    done
  done
}
