"""One vLLM engine (its CPU build) with or without kvtier's connector, run by
tests/test_vllm_connector.py in the interpreter of a venv that has vLLM (`KVTIER_VLLM_PYTHON`).

Usage: python tests/vllm_run.py '{"model": DIR, "store": PATH|null, "storage": URL|null,
"prefix_caching": bool, "host_gb": float, "block_size": N, "runs": N, "prompts": [k, ...], "gates": DIR|null,
"max_tokens": N}' -> one JSON line per run, as it ends: the greedy tokens and the tokens vLLM
counted as cached. Run i asks prompt `prompts[i]` (default 0; each 1,536 tokens of SmolLM2, 12
blocks of 128, no block shared between prompts); with `gates`, run i > 0 starts once the file
`gates/i` exists (a test does something between runs).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPT = "Summarise this list: " + " ".join(f"word{i % 97} thing{i % 13}" for i in range(300))


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
    )
    params = SamplingParams(temperature=0, max_tokens=args.get("max_tokens", 12))
    runs = args.get("runs", 1)
    for i, k in enumerate(args.get("prompts") or [0] * runs):
        if i and args.get("gates"):
            while not os.path.exists(os.path.join(args["gates"], str(i))):
                time.sleep(0.1)
        out = llm.generate([prompt(k)], params, use_tqdm=False)[0]
        row = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
        row["prompt"] = len(out.prompt_token_ids)
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
