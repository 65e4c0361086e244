"""Continuous batching on CUDA: batched greedy tokens against `model.generate`, then step times.

Part 1 (correctness, fp32 on the GPU): tiny GQA and MLA models, eight requests of mixed
lengths batched with a device pool small enough to preempt and a host tier that reloads;
every request's tokens against plain `model.generate`. Part 2 (timing, bf16): a
Llama-3.1-8B-shaped model with random weights; a decode step's time at 1, 8, 32 and 64
running requests of `CTX` tokens each, and one prefill step of 2048 tokens.

`python3 bench/probes/probe_step_batch.py OUT.json [CTX=1024]` (tests/ on `PYTHONPATH`).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import transformers

from kvtier.engine import Engine, SamplingParams


def tiny(kind: str) -> torch.nn.Module:
    sys.path.insert(0, "tests")
    from tiny_models import tiny_deepseek_v3, tiny_llama

    return (tiny_llama if kind == "gqa" else tiny_deepseek_v3)().cuda()


def correctness() -> dict:
    out = {}
    for kind in ("gqa", "mla"):
        model = tiny(kind)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 40, 70, 33, 12, 60, 25, 48)
        ]
        refs = []
        with torch.no_grad():
            for p in prompts:
                o = model.generate(
                    torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False, min_new_tokens=12
                )
                refs.append(o[0, len(p) :].tolist())
        eng = Engine(model, device_tokens=256, host_tokens=2048, max_num_batched_tokens=64)
        ok = True
        for _ in range(3):  # rounds 2 and 3 find the prompts on the device or the host
            reqs = [eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
            res = {}
            while eng.busy:
                for u in eng.step():
                    if u.error is not None:
                        raise u.error
                    if u.result is not None:
                        res[u.request.id] = u.result
            ok &= all(res[r.id].tokens == ref for r, ref in zip(reqs, refs, strict=True))
            eng.cache.evict_device(10**9)
        out[kind] = {
            "tokens_equal": ok,
            "preemptions": eng.stats.preemptions,
            "host_hit_tokens": eng.cache.metrics.host_hit_tokens,
        }
        eng.cache.flush()
        eng.cache.check_invariants()
        eng.close()
    return out


def llama_8b() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    return model


def timing(ctx: int) -> dict:
    model = llama_8b()
    out = {"ctx": ctx, "decode": []}
    eng = Engine(
        model, device_tokens=80 * 1024, host_tokens=1024, max_num_batched_tokens=8192, max_num_seqs=64
    )
    gen = torch.Generator().manual_seed(1)
    for n in (1, 8, 32, 64):
        reqs = [
            eng.submit(
                torch.randint(0, 128000, (ctx,), generator=gen).tolist(),
                SamplingParams(max_tokens=40, ignore_eos=True),
            )
            for _ in range(n)
        ]
        while any(len(r.tokens) == 0 for r in reqs):
            eng.step()
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        steps = 20
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / steps
        out["decode"].append({"running": n, "step_ms": dt * 1e3, "tokens_per_s": n / dt})
        print(out["decode"][-1], flush=True)
        for r in reqs:
            eng.cancel(r)
    p = torch.randint(0, 128000, (2048,), generator=gen).tolist()
    req = eng.submit(p, SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while not req.finished:
        eng.step()
    torch.cuda.synchronize()
    out["prefill_2048_s"] = time.perf_counter() - t
    eng.close()
    return out


if __name__ == "__main__":
    path = sys.argv[1]
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    result = {"correctness": correctness()}
    print(result, flush=True)
    result["timing"] = timing(ctx)
    result["torch"] = torch.__version__
    result["transformers"] = transformers.__version__
    result["gpu"] = torch.cuda.get_device_name()
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
