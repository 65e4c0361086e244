"""`kvtier bench batching | multiturn | served | storage | vllm`: the benchmarks of the engine and the storage
tier, their flags made into each benchmark's config, the runs, the tables and the JSON reports."""

from __future__ import annotations

import json
import os
import tempfile
from argparse import Namespace
from dataclasses import asdict, replace
from pathlib import Path

import torch

from kvtier.bench import (
    batching,
    multiturn,
    multiturn_plan,
    multiturn_report,
    served,
    storage,
    vllm,
    vllm_report,
)
from kvtier.bench.common import environment
from kvtier.bench.engines import bench_model
from kvtier.bench.multiturn import EngineSetup
from kvtier.bench.multiturn_plan import Plan
from kvtier.bench.multiturn_trace import read_trace
from kvtier.cli.build import device
from kvtier.cli.console import console, progress, write_json
from kvtier.errors import ConfigError


def bench_batching(args: Namespace) -> int:
    """`kvtier bench batching`: the model, then both parts; table and `--json`."""
    dev = device(args.device)
    bench = batching.BatchingBench(
        requests=args.concurrent,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        running=args.running,
        decode_prompt_tokens=args.decode_prompt_tokens,
        steps=args.steps,
        seed=args.seed,
        parts=args.parts,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    with progress() as report:
        report("building the model")
        model, tokenizer, name = bench_model(args.model, args.shape, dev, args.dtype)
        together, rows, summary = batching.run(
            model,
            tokenizer,
            bench,
            args.device_tokens,
            report,
            args.enforce_eager,
        )
    meta = {**environment(dev), **summary, "model": name, **asdict(bench)}
    console.print(batching.render(together, rows, meta))
    write_json(args.json, {"meta": meta, "concurrent": together, "decode": [asdict(r) for r in rows]})
    return 0


def bench_multiturn(args: Namespace) -> int:
    """`kvtier bench multiturn`: the model, then each table's repeats; tables, `--json`, `--plot`.

    `--from-json FILE...` runs nothing: it shows the tables of reports written before (with
    several, whether their figures agree), plots the first, and `--json` keeps them in one file.
    """
    if args.plot is not None:  # a missing matplotlib is refused before any work (`kvtier.cli.parser.main`)
        import matplotlib  # noqa: F401
    if args.from_json is not None:
        reports = [r for path in args.from_json for r in multiturn_report.load(json.loads(path.read_text()))]
        if len(args.from_json) > 1 or len(reports) > 1:
            write_json(args.json, {"reports": reports})
    else:
        reports = [_multiturn(args)]
    for report in reports:
        console.print(multiturn_report.render(report))
    if len(reports) > 1:
        console.print(multiturn_report.render_agreement(reports))
    for report in reports:
        orders = multiturn_report.by_order(report)
        if len(orders) > 1 and min(len(t["runs"]) for o in orders for t in o["tables"] if t["runs"]) > 1:
            console.print(multiturn_report.render_agreement(orders, "order"))  # each order twice or more
    if args.plot is not None:
        multiturn_report.write_plot(args.plot, reports[0])
        console.print(f"wrote {args.plot}")
    return 0


def _plans(args: Namespace) -> tuple[dict, list[tuple[str, Plan]]]:
    """The flags that made the plans, and each table's label and plan (`ConfigError` before any work)."""
    if args.trace is not None:
        if args.request_rate is not None or args.output_tokens is not None:
            raise ConfigError(
                "--trace gives each request's arrival and answer length: drop --request-rate and "
                "--output-tokens"
            )
        return {"trace": str(args.trace)}, [(f"trace {args.trace.name}", read_trace(args.trace, args.seed))]
    workload = multiturn_plan.Workload(
        clients=args.clients,
        rounds=args.rounds,
        context_tokens=args.context_tokens,
        question_tokens=args.question_tokens,
        request_rate=args.request_rate,
        seed=args.seed,
    )
    lengths = args.output_tokens or (16,)
    plans = [(f"output {n}", replace(workload, output_tokens=n).plan()) for n in lengths]
    return {**asdict(workload), "output_tokens": list(lengths)}, plans


def _multiturn(args: Namespace) -> dict:
    """Build the model and run every table; `--json` is rewritten after each configuration's run."""
    dev = device(args.device)
    workload, plans = _plans(args)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // 2))
    setup = EngineSetup(
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    with progress() as report:
        report("building the model")
        model, tokenizer, name = bench_model(args.model, args.shape, dev, args.dtype)
        meta = multiturn.meta_of(model, name, setup, workload, dev)
        meta.update(
            configs=list(args.configs), repeats=args.repeats, order=args.order, warm_run=not args.no_warm_run
        )
        meta.update(threads=torch.get_num_threads(), cores=os.cpu_count())
        tables = [multiturn.table_of(label, plan, setup, meta["kv_bytes_per_token"]) for label, plan in plans]
        out = {"meta": meta, "tables": tables}
        multiturn.run(
            model,
            tokenizer,
            args.configs,
            setup,
            tables,
            [plan for _, plan in plans],
            args.repeats,
            multiturn.Order(args.order),
            report,
            lambda _tables: write_json(args.json, out),
            not args.no_warm_run,
        )
    return out


def bench_served(args: Namespace) -> int:
    """`kvtier bench served`: prefixes default to 8k-128k on CUDA, 256 and 1024 on the CPU."""
    dev = device(args.device)
    prefixes = args.prefix or ((8192, 32768, 131072) if dev.type == "cuda" else (256, 1024))
    with progress() as report:
        rows, meta = served.run(args.setups, prefixes, dev, args.cycles, args.repeats, report, args.layers)
    console.print(served.render(rows, meta))
    write_json(args.json, {"meta": meta, "rows": served.rows_as_dicts(rows)})
    return 0


def bench_storage(args: Namespace) -> int:
    """`kvtier bench storage`: 0 when every check held, else 1."""
    dev = device(args.device)
    cuda = dev.type == "cuda"
    bench = storage.StorageBench(
        root=args.dir or Path(tempfile.gettempdir()),
        parts=tuple(storage.Part(p) for p in args.parts),
        backends=args.backends,
        specs=args.specs,
        page_sizes=args.page_sizes,
        layout=args.layout,
        redis=args.redis,
        tokens=(2048, 4096, 8192, 16384, 32768) if cuda else (2048, 4096, 8192),
        setup=args.setup or ("deepseek-v3" if cuda else "smollm2"),
        miss_repeats=args.miss_repeats,
        drop_caches=args.drop_caches,
        device=dev,
    )
    if args.quick:
        bench = bench.quick()
    given = {"tokens": args.tokens, "repeats": args.repeats}
    bench = replace(bench, **{k: v for k, v in given.items() if v is not None})
    with progress() as report:
        result = storage.run(bench, report)
    console.print(storage.render(result))
    write_json(args.json, result)
    checks = [r["identical"] for part in ("throughput", "compression") for r in result[part]]
    checks += [r["same_first_token"] for r in result["ttft"]]
    return 0 if all(checks) else 1


def bench_vllm(args: Namespace) -> int:
    """`kvtier bench vllm`: 0 when every kvtier hit in vLLM answered as vLLM's own prefix cache did."""
    from kvtier.engine.models import checkpoint_folder

    bench = vllm.VLLMBench(
        vllm_python=vllm.vllm_python(args.vllm_python),
        model=Path(checkpoint_folder(args.model)),
        tokens=args.tokens,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        host_gb=args.host_gb,
        store=args.store,
        kvtier_server=not args.no_kvtier_server,
        dtype=args.dtype,
        vllm_args=tuple(args.vllm_arg) if args.vllm_arg else vllm.VLLMBench.vllm_args,
    )
    with progress() as report:
        result = vllm.run(bench, report)
    console.print(vllm_report.render(result))
    write_json(args.json, result)
    return 0 if all(r["same_as_prefix_cache"] is not False for r in result["rows"]) else 1
