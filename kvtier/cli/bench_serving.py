"""`kvtier bench batching | multiturn | served | storage | vllm`: the benchmarks of the engine and the storage
tier, their flags made into each benchmark's config, the runs, the tables and the JSON reports."""

from __future__ import annotations

import json
import tempfile
from argparse import Namespace
from dataclasses import asdict, replace
from pathlib import Path

from kvtier.bench import batching, multiturn, multiturn_report, served, storage, vllm, vllm_report
from kvtier.bench.common import environment
from kvtier.bench.engines import bench_model
from kvtier.bench.multiturn import EngineSetup
from kvtier.cli.build import device
from kvtier.cli.console import console, progress, write_json


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
    )
    with progress() as report:
        report("building the model")
        model, tokenizer, name = bench_model(args.model, args.shape, dev, args.dtype)
        together, rows, summary = batching.run(
            model, tokenizer, bench, args.device_tokens, args.max_num_batched_tokens, report
        )
    meta = {**environment(dev), **summary, "model": name, **asdict(bench)}
    console.print(batching.render(together, rows, meta))
    write_json(args.json, {"meta": meta, "concurrent": together, "decode": [asdict(r) for r in rows]})
    return 0


def bench_multiturn(args: Namespace) -> int:
    """`kvtier bench multiturn`: the model, then each configuration; table, `--json`, `--plot`.

    `--from-json FILE` runs nothing: it shows the table of a report written before, and plots it.
    """
    if args.plot is not None:  # a missing matplotlib is refused before any work (`kvtier.cli.parser.main`)
        import matplotlib  # noqa: F401
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        meta, configs = report["meta"], report["configs"]
    else:
        meta, configs = _multiturn(args)
    console.print(multiturn_report.render(configs, meta))
    if args.plot is not None:
        multiturn_report.write_plot(args.plot, configs, meta)
        console.print(f"wrote {args.plot}")
    return 0


def _multiturn(args: Namespace) -> tuple[dict, list[dict]]:
    """Build the model and run the configurations; `--json` is rewritten after each one."""
    dev = device(args.device)
    workload = multiturn.Workload(
        clients=args.clients,
        rounds=args.rounds,
        context_tokens=args.context_tokens,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        request_rate=args.request_rate,
        seed=args.seed,
    )
    setup = EngineSetup(
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )

    def save(done: list[dict]) -> None:
        meta["ratios"] = multiturn.ratios(done)
        write_json(args.json, {"meta": meta, "configs": done})

    with progress() as report:
        report("building the model")
        model, tokenizer, name = bench_model(args.model, args.shape, dev, args.dtype)
        meta = multiturn.meta_of(model, name, setup, workload, dev)
        configs = multiturn.run(model, tokenizer, args.configs, setup, workload, report, save)
    return meta, configs


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
