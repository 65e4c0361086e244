"""`kvtier bench cache`: the tiered prefix cache driven the way a serving engine drives it.

Parts, each in its own module, each rendering its own table:

- `trace` (`kvtier.bench.trace`): a multi-turn chat trace under device-memory pressure,
  once per write policy;
- `alloc` (`kvtier.bench.allocator`): the host slot allocator at millions of slots after
  heavy churn;
- `reload` (`kvtier.bench.reload`): a long prefix evicted to the host and loaded back
  through `match` + `load_back`;
- `eviction` (`kvtier.bench.eviction`): evicting k nodes of a tree of many nodes, per
  eviction policy.

Parts run one after the other; each part's pools are closed and collected before the
next part builds its own. `--json` writes `{"meta": ..., "<part>": rows, ...}`.
"""

from __future__ import annotations

import importlib
from argparse import Namespace
from dataclasses import asdict

from kvtier.bench.common import Progress, close, collect
from kvtier.errors import ConfigError


def command(args: Namespace) -> int:
    """`kvtier bench cache --parts ...`: run the parts asked for, print their tables, write the JSON."""
    from kvtier.bench import trace
    from kvtier.cache import WritePolicy
    from kvtier.cli.build import device
    from kvtier.cli.console import console, progress, write_json
    from kvtier.spec import preset

    dev = device(args.device)
    spec = preset(args.spec or ("deepseek-v3" if dev.type == "cuda" else "tiny-mla"), args.page_size)
    if args.layers is not None and args.layers > spec.num_layers:
        raise ConfigError(
            f"--layers {args.layers} must be in [1, {spec.num_layers}], the layers of {spec.name}"
        )
    trace_spec = spec.with_layers(args.layers) if args.layers else spec
    policies = [w.value for w in WritePolicy] if args.write_policy == "all" else [args.write_policy]
    cfg = trace.TraceConfig(
        spec=trace_spec,
        device=dev,
        device_slots=args.device_slots,
        host_slots=args.host_slots,
        conversations=args.conversations,
        turns=args.turns,
        active=args.active,
        seed=args.seed,
    )
    out: dict = {}
    extra: dict = {}
    with progress() as report:
        if "trace" in args.parts:
            out["trace"] = _trace(cfg, policies, report)
        if "alloc" in args.parts:
            out["alloc"] = _allocator(args, report)
        if "reload" in args.parts:
            out["reload"] = _reload(args, spec, dev, report)
        if "eviction" in args.parts:
            out["eviction"], extra["eviction"] = _eviction(args, report)
    meta = trace.metadata(
        cfg,
        policies,
        alloc={"slots": args.alloc_slots, "churn": args.alloc_churn, "pairs": args.alloc_pairs},
        reload={"spec": spec.name, "layers": spec.num_layers, "tokens": args.reload_tokens},
        **extra,
    )
    for part, rows in out.items():
        console.print(_render(part, rows, meta))
    rows = {k: [asdict(x) for x in v] if isinstance(v, list) else asdict(v) for k, v in out.items()}
    write_json(args.json, {"meta": meta, **rows})
    return 0


# The module of each part, whose `render(rows, meta)` draws its table.
_MODULES = {
    "trace": "kvtier.bench.trace",
    "alloc": "kvtier.bench.allocator",
    "reload": "kvtier.bench.reload",
    "eviction": "kvtier.bench.eviction",
}


def _render(part: str, rows, meta: dict):
    module = importlib.import_module(_MODULES[part])
    return module.render(rows, meta[part] if part == "eviction" else meta)


def _trace(cfg, policies: list[str], report: Progress) -> list:
    """One trace row per write policy, every controller over the same pools (closed at the end)."""
    from kvtier.bench import trace

    trace.check_fits(cfg, trace.make_trace(cfg))  # before any pool is built
    pools = trace.build_pools(cfg)
    try:
        return [trace.run_trace(cfg, p, pools, report).row for p in policies]
    finally:
        close(*pools)
        del pools
        collect()


def _allocator(args: Namespace, report: Progress) -> list:
    from kvtier.bench.allocator import run_allocator

    return run_allocator(
        args.alloc_slots, args.page_size, args.alloc_churn, args.alloc_pairs, seed=args.seed, progress=report
    )


def _reload(args: Namespace, spec, dev, report: Progress):
    from kvtier.bench.reload import run_prefix_reload

    row = run_prefix_reload(
        spec,
        args.reload_tokens,
        dev,
        args.reload_repeats,
        seed=args.seed,
        progress=report,
        query_ids=args.reload_ids,
        host_runs=args.reload_host_runs,
        host_layout=args.reload_layout,
    )
    collect()  # the reload's pools, gone with its frame
    return row


def _eviction(args: Namespace, report: Progress) -> tuple[list, dict]:
    from kvtier.bench import eviction

    report(f"eviction: {args.evict_k} of {args.evict_nodes} nodes per policy")
    return eviction.run(nodes=args.evict_nodes, evict=args.evict_k, seed=args.seed)
