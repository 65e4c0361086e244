#!/usr/bin/env bash
# bench/RESULTS.md "Transfer": `kvtier bench transfer` for four specs at 4096, 8192, 32768 and 131072
# tokens, every host and device set, planned against the kernel and the copy engine forced, in one
# process per spec (~5 minutes on an H100). Writes $OUT/transfer_<spec>.json and .log, env.txt.
# Usage, from the repository root on the GPU machine: bash bench/device/transfer.sh [specs...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TOKENS=${TOKENS:-4096,8192,32768,131072}
EXTRA=()
[ "${SMOKE:-0}" = 1 ] && EXTRA=(--device cpu --repeats 1 --warmup 0) && TOKENS=256,512
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  python3 -c "import platform, torch, triton; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/env.txt"
for spec in "${@:-deepseek-v3 llama-3.1-8b glm-5 deepseek-v3-fp8-packed}"; do
  for s in $spec; do
    timeout "${TIMEOUT:-240}" python3 -m kvtier bench transfer --spec "$s" --tokens "$TOKENS" --cycles 6 \
      --repeats 5 --batch 2 --warmup 1 --json "$OUT/transfer_$s.json" "${EXTRA[@]}" > "$OUT/transfer_$s.log" 2>&1
    echo "$s rc=$?"
    python3 - "$OUT/transfer_$s.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("costs", d["meta"].get("costs"))
for t in sorted({c["tokens"] for c in d["cells"]}):
    cs = [c for c in d["cells"] if c["tokens"] == t]
    gaps = [c["gap"] for c in cs if c["gap"] is not None]
    bad = [f"{c['direction'][0]}:{c['host']}/{c['device'][0]} {c['gap']:+.3f}" for c in cs if (c["gap"] or 0) < -0.02]
    vk = [round(c["ratios"]["planned"] - c["ratios"]["kernel"], 3) for c in cs if "kernel" in c["ratios"]]
    vf = [c["vs_fixed"] for c in cs if c.get("vs_fixed") is not None]
    pl = sorted(c["ratios"]["planned"] for c in cs)
    hb = [f"{c['direction'][0]}:{c['host']}/{c['device'][0]}" for c in cs if c.get("host_bound", {}).get(c["best_forced"])]
    print(t, "planned min/med", pl[0], pl[len(pl) // 2], "worst gap", min(gaps), "vs kernel min", min(vk, default=None),
          "vs fixed min/max", min(vf, default=None), max(vf, default=None), "ok", all(c["identical"] for c in cs), "below -0.02:", bad, "best forced host-bound:", hb)
PY
  done
done
