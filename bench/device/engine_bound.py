"""Issue 43's engine figures in one process: decode steps (eager and CUDA graphs) and prefill of
2048-token pieces with the Llama-3.1-8B shape (random bf16 weights), next to the same run's bounds:
a device-to-device copy of the weights' bytes (reading them once) and a bf16 8192^3 matmul rate.
Usage (from bench/device/engine.sh): python3 bench/device/engine_bound.py OUT.json [--smoke]
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from kvtier.bench import batching
from kvtier.bench.common import environment
from kvtier.bench.engines import bench_model
from kvtier.engine import Engine, SamplingParams


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` (CUDA events around each)."""
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def weight_copy_s(nbytes: int, dev) -> float:
    """Median seconds to copy `nbytes` device to device (1 GiB chunks: reads every byte once)."""
    chunk = 1 << 30
    src = torch.empty(chunk, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def copy():
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            dst[:n].copy_(src[:n])
            left -= n

    copy()
    return float(np.median(timed(copy, 5)))


def matmul_tflops(dev) -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    s = float(np.median(timed(lambda: [a @ b for _ in range(10)], 5))) / 10
    return 2 * 8192**3 / s / 1e12


def prefill_s(model, dev, tokens: int, repeats: int) -> list[float]:
    """Seconds of one step that prefills a fresh `tokens`-token prompt (one piece), per repeat."""
    eng = Engine(
        model,
        device_tokens=4 * tokens,
        host_tokens=4 * tokens,
        max_num_batched_tokens=tokens,
        prefix_cache=False,
    )
    rng = np.random.default_rng(1)
    vocab = int(model.get_input_embeddings().num_embeddings)
    out = []
    try:
        for i in range(repeats + 1):
            eng.submit(rng.integers(0, vocab, tokens).tolist(), SamplingParams(max_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            if i:
                out.append(time.perf_counter() - t0)
            while eng.busy:
                eng.step()
    finally:
        eng.close()
    return out


def main() -> None:
    path, smoke = sys.argv[1], "--smoke" in sys.argv
    dev = torch.device("cuda")
    shape = "tiny" if smoke else "llama-3.1-8b"
    model, tok, name = bench_model(None, shape, dev, "bfloat16")
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    report = {"meta": {**environment(dev), "model": name, "weight_bytes": nbytes, "params": params}}
    report["weight_copy_s"] = copy_s = weight_copy_s(nbytes, dev)
    report["matmul_tflops"] = peak = matmul_tflops(dev)
    copy_ms = copy_s * 1e3
    print(f"weights {nbytes / 1e9:.2f} GB: copy {copy_ms:.2f} ms; bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    running = (1, 4) if smoke else (1, 16, 64)
    bench = batching.BatchingBench(running=running, decode_prompt_tokens=512, steps=20, parts=("decode",))
    for mode, eager in (("eager", True), ("graphs", False)):
        _, rows, _ = batching.run(model, tok, bench, enforce_eager=eager)
        report[f"decode_{mode}"] = [
            {**asdict(r), "x_weight_copy": round(r.ms_per_step / 1e3 / copy_s, 3)} for r in rows
        ]
        for r in rows:
            print(
                f"decode {mode} {r.running:3d} running: {r.ms_per_step:.2f} ms/step "
                f"({r.ms_per_step / 1e3 / copy_s:.2f}x the weight copy)",
                flush=True,
            )
    piece = 256 if smoke else 2048
    times = prefill_s(model, dev, piece, 3)
    cfg = model.config
    attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * piece * piece / 2
    flops = 2 * (params - embed) * piece + attn
    s = float(np.median(times))
    report["prefill"] = {
        "tokens": piece,
        "seconds": times,
        "tokens_per_s": round(piece / s, 1),
        "tflops": round(flops / s / 1e12, 1),
        "of_matmul": round(flops / s / 1e12 / peak, 3),
    }
    print(
        f"prefill {piece}: {s * 1e3:.1f} ms, {flops / s / 1e12:.0f} TFLOP/s = "
        f"{flops / s / 1e12 / peak:.2f} of the matmul",
        flush=True,
    )
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
