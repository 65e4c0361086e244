"""One vLLM engine (its CPU build) with or without kvtier's connector, run by
tests/test_vllm_connector.py in the interpreter of a venv that has vLLM (`KVTIER_VLLM_PYTHON`).

Usage: python tests/vllm_run.py '{"model": DIR, "store": PATH|null, "storage": URL|null,
"prefix_caching": bool, "host_gb": float, "block_size": N, "runs": N, "prompts": [k, ...], "gates": DIR|null,
"max_tokens": N, "scenario": "preempt"|"abort"|null, "blocks": N, "batched": N}'
-> one JSON line per run, as it ends: the greedy tokens and the tokens vLLM counted as cached.
Run i asks prompt `prompts[i]` (default 0; each 1,536 tokens of SmolLM2, 12 blocks of 128, no
block shared between prompts); with `gates`, run i > 0 starts once the file
`gates/i` exists (a test does something between runs).

A `scenario` drives the engine step by step in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
the scheduler and its connector are reachable here; the worker's through `collective_rpc`) and
prints one line `STATE {...}` once vLLM is idle: vLLM's free blocks and both connector sides'
`state()`. `preempt`: the first 3/5 of prompts 0-3 at once, `max_tokens` each (no early end), in `blocks`
KV blocks (too few: vLLM preempts);
`abort`: prompt 1 computed (its pages stored), prompt 2 aborted mid-prefill (`batched` tokens a
step), prompt 1 again (a fetch from storage: the host pool is too small to keep its blocks)
aborted while it fetches, then prompt 1 once more, answered.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvtier.storage.file import FileBackend

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if "scenario" in sys.argv[-1]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of a function
# `vllm_run:SlowFiles?...` storage URLs: this folder on the worker's path too.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p
)

PROMPT = "Summarise this list: " + " ".join(f"word{i % 97} thing{i % 13}" for i in range(300))


class SlowFiles(FileBackend):
    """A file store whose every read takes `delay` seconds more: a fetch from it is still running
    when a test aborts its request (storage URL `vllm_run:SlowFiles?path=DIR&delay=S`)."""

    def __init__(self, path: str, delay: str = "0") -> None:
        super().__init__(path)
        self.delay = float(delay)

    def get_into(self, keys, buffers):
        time.sleep(self.delay)
        return super().get_into(keys, buffers)


def prompt(k: int) -> str:
    """Prompt `k` (0: `PROMPT`); others start differently, so no block is shared."""
    return (
        PROMPT
        if k == 0
        else f"List {k} to summarise: " + " ".join(f"item{(i * k) % 89} x{i % 7}" for i in range(300))
    )


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"host_gb": args.get("host_gb", 0.25)}
    if args.get("store"):
        extra["storage"] = "file://" + args["store"]
    if args.get("storage"):
        extra["storage"] = args["storage"]
    transfer = KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    llm = LLM(
        model=args["model"],
        enforce_eager=True,
        enable_prefix_caching=args.get("prefix_caching", False),
        kv_transfer_config=transfer,
        max_model_len=2048,
        block_size=args.get("block_size", 128),
        num_gpu_blocks_override=args.get("blocks"),
        max_num_batched_tokens=args.get("batched"),
    )
    params = SamplingParams(temperature=0, max_tokens=args.get("max_tokens", 12))
    if args.get("scenario"):
        scenario(llm, args["scenario"], params)
        return
    runs = args.get("runs", 1)
    for i, k in enumerate(args.get("prompts") or [0] * runs):
        if i and args.get("gates"):
            while not os.path.exists(os.path.join(args["gates"], str(i))):
                time.sleep(0.1)
        out = llm.generate([prompt(k)], params, use_tqdm=False)[0]
        row = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
        row["prompt"] = len(out.prompt_token_ids)
        print("RESULT " + json.dumps(row), flush=True)


def worker_state(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    connector._host.flush()  # the storage writes queued so far
    return connector.state()


def scenario(llm, name: str, params) -> None:
    """See the module docstring."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    preempted, out = set(), {}

    def run(until=lambda: False, steps: int | None = None, seconds: float = 300) -> None:
        """Step until `until()`, `steps` steps, nothing is left, or `seconds` passed."""
        deadline, n = time.monotonic() + seconds, 0
        while time.monotonic() < deadline and (steps is None or n < steps):
            if until() or not (engine.has_unfinished_requests() or sched.requests):
                return
            outputs, n = engine.step(), n + 1
            for o in outputs:
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
            preempted.update(r.split("-")[0] for r, req in sched.requests.items() if req.num_preemptions)
            if not outputs:
                time.sleep(0.01)  # a fetch runs (or an aborted one still holds its blocks)

    def request(req_id: str):  # the scheduler's request of an id we gave (it adds a suffix)
        return next((r for k, r in sched.requests.items() if k.split("-")[0] == req_id), None)

    def computed(req_id: str, tokens: int):
        return lambda: (r := request(req_id)) is not None and r.num_computed_tokens >= tokens

    if name == "preempt":  # ~7 blocks each: two fit, and outgrow the blocks as they decode
        params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        for k in range(4):
            engine.add_request(f"p{k}", prompt(k)[: len(prompt(k)) * 3 // 5], params)
        run()
    else:
        for req_id, k in (("first", 1), ("fill", 3)):  # prompt 3 pushes prompt 1 out of the host
            engine.add_request(req_id, prompt(k), params)
            run()
        llm.collective_rpc(worker_state)  # their pages are in storage now
        engine.add_request("cut", prompt(2), params)
        run(until=computed("cut", 1))
        cut_at = request("cut").num_computed_tokens
        engine.abort_request(["cut"])
        engine.add_request("fetching", prompt(1), params)
        run(steps=1)
        fetch_status = request("fetching").status.name
        engine.abort_request(["fetching"])
        status = {k: r.status.name for k, r in sched.requests.items()}
        run(seconds=10)  # no request left: the engine steps on only while kvtier says it must
        after_abort = {"free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks()}
        after_abort |= {
            "requests": len(sched.requests),
            "scheduler": sched.connector.state(),
            "status": status,
        }
        engine.add_request("again", prompt(1), params)
        run()
    pool = sched.kv_cache_manager.block_pool
    state = {
        "free_blocks": pool.get_num_free_blocks(),
        "blocks": pool.num_gpu_blocks,
        "preempted": sorted(preempted),
        **(
            {"cut_at": cut_at, "fetch_status": fetch_status, "after_abort": after_abort}
            if name == "abort"
            else {}
        ),
        "finished": sorted(out),
        "left": {k: r.status.name for k, r in sched.requests.items()},
        "tokens": out,
        "scheduler": sched.connector.state(),
        "workers": llm.collective_rpc(worker_state),
    }
    print("STATE " + json.dumps(state), flush=True)


if __name__ == "__main__":
    main()
