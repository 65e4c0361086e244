"""The `kvtier` command: `kvtier demo`, `kvtier bench transfer | overlap | cache ...`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvtier.errors import KVTierError
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.spec import PRESETS, preset
from kvtier.transfer import KernelOptions

# Wide enough for the tables when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 140)


def _kernel_shape(text: str) -> KernelOptions:
    """`PROGRAMSxROWS` (8x32), or `PROGRAMS` alone (4) for rows chosen by row size and budget;
    either followed by `sSTAGES` (8s1, 8x32s2) for the tiles each program keeps in flight."""
    shape, sep, stages = text.lower().partition("s")
    try:
        sm, *rows = (int(x) for x in shape.split("x"))
        depth = int(stages) if sep else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected PROGRAMSxROWS such as 8x32 or 8x32s2, got {text!r}"
        ) from None
    if len(rows) > 1 or min(sm, *rows, 1 if depth is None else depth) < 1:
        raise argparse.ArgumentTypeError(f"kernel shape {text!r} must be one or two positive numbers")
    return KernelOptions(sm_budget=sm, rows_per_program=rows[0] if rows else None, stages=depth)


def _positive(text: str) -> int:
    """A count of at least 1, refused by the parser (with its usage line) otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", choices=sorted(PRESETS), help="KV spec preset (default: deepseek-v3)")
    p.add_argument("--tokens", type=int, help="prefix length (default: 131072 on CUDA, 16384 on CPU)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--layout", choices=[m.value for m in HostLayout], default=HostLayout.LAYER_FIRST.value)
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="back-to-back calls per timed sample")
    p.add_argument(
        "--kernel",
        type=_kernel_shape,
        default=None,
        help="gather kernel PROGRAMSxROWS, or PROGRAMS with rows by row size (default 8); then sSTAGES",
    )
    p.add_argument("--json", type=Path, help="also write the rows and metadata to this file")


def _parser() -> argparse.ArgumentParser:
    from kvtier.bench.transfer import HOST_SETS, VARIANTS

    p = argparse.ArgumentParser(prog="kvtier", description="Hierarchical KV cache for LLM serving.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="an OpenAI-compatible server over the tiered cache")
    s.add_argument("--model", help="a local transformers checkpoint (default: SmolLM2-135M-Instruct)")
    s.add_argument("--model-name", help="the name clients ask for (default: the checkpoint's folder name)")
    s.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    s.add_argument("--device-tokens", type=int, default=16384, help="device KV pool in tokens")
    s.add_argument("--host-tokens", type=int, default=131072, help="host KV pool in tokens")
    s.add_argument(
        "--write-policy", default="write_through", help="write_through, write_through_selective, write_back"
    )
    s.add_argument("--host-layout", default="layer_first", help="layer_first or page_first")
    s.add_argument(
        "--host-alloc", default="contiguous", help="host allocator policy: contiguous or first_fit"
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=int, default=8000)

    d = sub.add_parser("demo", help="multi-turn chats on a real model, earlier turns evicted and reloaded")
    d.add_argument("--model", help="a local transformers checkpoint (default: SmolLM2-135M-Instruct)")
    d.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    d.add_argument(
        "--device-tokens", type=int, default=320, help="device KV budget in tokens (small: forces reloads)"
    )
    d.add_argument("--host-tokens", type=int, default=16384, help="host KV pool in tokens")
    d.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per answer")
    d.add_argument(
        "--policy", default="write_through", help="write_through, write_through_selective, write_back"
    )
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    t = bench.add_parser("transfer", help="host <-> device transfer paths at every fragmentation")
    _common(t)
    t.add_argument("--direction", choices=["load", "backup", "both"], default="both")
    t.add_argument("--cycles", type=int, default=8, help="fill/evict cycles before the churn rows")
    t.add_argument("--host-sets", type=_csv, default=HOST_SETS, help=f"comma list of {','.join(HOST_SETS)}")
    t.add_argument("--device-sets", type=_csv, default=("contiguous", "scattered"))
    t.add_argument("--variants", type=_csv, default=VARIANTS, help=f"comma list of {','.join(VARIANTS)}")
    t.add_argument(
        "--kernel-sweep",
        type=lambda s: tuple(_kernel_shape(x) for x in s.split(",") if x),
        default=(),
        help="extra kernel shapes timed on the fully scattered set, e.g. 4x32,8x64,8s1",
    )
    t.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers each timed call moves (page_first kernel rows then move in layer groups)",
    )

    o = bench.add_parser("overlap", help="reload and backup at once; a matmul beside a reload (CUDA)")
    _common(o)
    o.add_argument("--rounds", type=int, default=5, help="alternating rounds with and without the reload")
    o.add_argument(
        "--rounds-log",
        type=Path,
        help="write each interference round (host times, rates) as a JSON line",
    )

    sv = bench.add_parser("served", help="TTFT of a miss, a device hit and a host hit, kvtier vs stock")
    sv.add_argument("--setups", type=_csv, default=("smollm2", "deepseek-v3"), help="smollm2,deepseek-v3")
    sv.add_argument(
        "--prefix",
        type=lambda s: tuple(int(x) for x in s.split(",") if x),
        help="prefix lengths (default: 8k-128k on CUDA, 256,1024 on CPU)",
    )
    sv.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    sv.add_argument("--cycles", type=int, default=4, help="fill/evict cycles that fragment the host pool")
    sv.add_argument("--repeats", type=int, default=3)
    sv.add_argument("--json", type=Path, help="also write the rows and metadata to this file")

    from kvtier.cache import WritePolicy

    c = bench.add_parser(
        "cache", help="the tiered prefix cache: a multi-turn trace, the allocator, a 128k reload"
    )
    c.add_argument(
        "--parts", type=_csv, default=("trace", "alloc", "reload"), help="comma list of trace,alloc,reload"
    )
    c.add_argument(
        "--spec", choices=sorted(PRESETS), help="KV spec (default: deepseek-v3 on CUDA, tiny-mla on CPU)"
    )
    c.add_argument("--layers", type=int, help="cut the spec to this many layers (trace only; default: all)")
    c.add_argument("--page-size", type=int, default=1)
    c.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    c.add_argument("--policy", choices=["all", *(w.value for w in WritePolicy)], default="all")
    c.add_argument("--device-slots", type=int, default=65536, help="device pool of the trace (tokens)")
    c.add_argument("--host-slots", type=int, default=262144, help="host pool of the trace (tokens)")
    c.add_argument("--conversations", type=int, default=64)
    c.add_argument("--turns", type=int, default=8, help="turns per conversation")
    c.add_argument("--active", type=int, default=8, help="conversations in progress at once")
    c.add_argument("--alloc-slots", type=int, default=4 * 1024 * 1024, help="allocator pool size")
    c.add_argument("--alloc-churn", type=int, default=60_000, help="random alloc/free before timing")
    c.add_argument("--alloc-pairs", type=int, default=2000, help="timed alloc + free pairs per size")
    c.add_argument("--reload-tokens", type=_positive, default=131072, help="prefix length of the reload")
    c.add_argument("--reload-repeats", type=_positive, default=5)
    c.add_argument(
        "--reload-host-runs",
        type=_positive,
        default=1,
        help="runs the prefix's host copy lies in (as after churn)",
    )
    c.add_argument(
        "--reload-ids", choices=("int32", "int64"), default="int32", help="dtype of the ids given to match"
    )
    c.add_argument(
        "--reload-layout",
        choices=[m.value for m in HostLayout],
        default=HostLayout.LAYER_FIRST.value,
        help="host layout of the reload's pool",
    )
    c.add_argument(
        "--reload-layers-per-load",
        type=_positive,
        default=1,
        help="layers a kernel reload moves per launch (page_first: layer groups)",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", type=Path, help="also write the rows and metadata to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "serve":
            return _serve(args)
        if args.bench == "transfer":
            return _bench_transfer(args)
        if args.bench == "cache":
            return _bench_cache(args)
        if args.bench == "served":
            return _bench_served(args)
        return _bench_overlap(args)
    except KVTierError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


def _demo(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from kvtier.cache import CacheConfig, WritePolicy
    from kvtier.engine import Engine
    from kvtier.engine.demo import CONVERSATIONS, run_demo
    from kvtier.engine.models import load_model

    device = _device(args.device)
    with console.status("loading the model (the first run converts it once, about a minute)"):
        model, tokenizer = load_model(args.model, device)
    engine = Engine(
        model,
        tokenizer,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        config=CacheConfig(write_policy=WritePolicy(args.policy)),
    )
    total = sum(len(c) for c in CONVERSATIONS)
    console.print(
        f"{engine.spec.name}: {engine.spec.num_layers} layers, "
        f"{engine.spec.bytes_per_token() // 1024} KiB of KV per token; "
        f"device budget {args.device_tokens} tokens, host {args.host_tokens}, on {device}"
    )
    table = Table(title="turns")
    for col in (
        "conv",
        "turn",
        "prompt",
        "hit",
        "device",
        "host",
        "reloaded",
        "reload",
        "TTFT",
        "same as plain",
    ):
        table.add_column(col, justify="left" if col in ("hit", "same as plain") else "right")
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("turns", total=total)

        def on_turn(t) -> None:
            r = t.result
            speed = ""
            if r.loaded_tokens and r.reload_s:
                speed = f"{r.loaded_bytes / 1e6 / r.reload_s:.0f} MB/s, {r.reload_s * 1e3:.1f} ms"
            elif r.loaded_tokens:
                speed = "overlapped"
            console.print(
                f"conv {t.conversation} turn {t.turn}: {r.prompt_tokens} prompt tokens, hit {r.hit} "
                f"(device {r.device_hit_tokens}, host {r.host_hit_tokens}), "
                f"reloaded {r.loaded_tokens} tokens "
                f"({r.loaded_bytes / 1e6:.1f} MB) {speed}, TTFT {r.ttft_s * 1e3:.0f} ms: {r.text!r}",
                highlight=False,
            )
            table.add_row(
                str(t.conversation),
                str(t.turn),
                str(r.prompt_tokens),
                r.hit,
                str(r.device_hit_tokens),
                str(r.host_hit_tokens),
                f"{r.loaded_bytes / 1e6:.1f} MB",
                speed,
                f"{r.ttft_s * 1e3:.0f} ms",
                "yes" if t.identical else "[red]NO[/red]",
            )
            progress.advance(task)

        turns = run_demo(engine, args.max_tokens, on_turn=on_turn)
    console.print(table)
    m = engine.cache.metrics
    same = sum(t.identical for t in turns)
    console.print(
        f"prompt tokens: {m.device_hit_tokens} from the device, {m.host_hit_tokens} from the host, "
        f"{m.miss_tokens} computed; {m.device_evictions} device evictions; "
        f"{m.bytes_h2d / 1e6:.1f} MB reloaded, {m.bytes_d2h / 1e6:.1f} MB backed up"
    )
    engine.cache.flush()
    engine.cache.check_invariants()
    console.print(f"answers identical to plain generation without cache reuse: {same} of {len(turns)}")
    return 0 if same == len(turns) else 1


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.alloc import AllocPolicy
    from kvtier.cache import CacheConfig, WritePolicy
    from kvtier.engine import Engine
    from kvtier.engine.models import DEFAULT_MODEL, load_model
    from kvtier.engine.server import create_app

    device = _device(args.device)
    with console.status("loading the model"):
        model, tokenizer = load_model(args.model, device)
    config = CacheConfig(
        write_policy=WritePolicy(args.write_policy), host_alloc_policy=AllocPolicy(args.host_alloc)
    )
    engine = Engine(
        model,
        tokenizer,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        config=config,
        host_layout=args.host_layout,
    )
    name = args.model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    console.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({device})")
    uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="warning")
    return 0


def _bench_served(args: argparse.Namespace) -> int:
    from kvtier.bench import served

    device = _device(args.device)
    cuda = device.type == "cuda"
    prefixes = args.prefix or ((8192, 32768, 131072) if cuda else (256, 1024))
    rows, meta = _run_with_progress(
        lambda report: served.run(args.setups, prefixes, device, args.cycles, args.repeats, report)
    )
    table = Table(title=f"TTFT, seconds (median of {args.repeats}), on {meta.get('gpu', device)}")
    cols = (
        "setup",
        "config",
        "prefix",
        "miss",
        "device hit",
        "host hit",
        "KV MB",
        "ceiling GB/s",
        "reload ratio",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("setup", "config") else "right")
    for r in rows:
        table.add_row(
            r.setup,
            r.config,
            str(r.prefix_tokens),
            f"{r.ttft_miss_s:.4f}",
            f"{r.ttft_device_hit_s:.4f}",
            f"{r.ttft_host_hit_s:.4f}",
            f"{r.kv_bytes / 1e6:.1f}",
            f"{r.ceiling_gbps:.1f}",
            f"{r.reload_overhead_ratio:.2f}",
        )
    console.print(table)
    console.print(
        "reload ratio: (host hit - device hit) / (KV bytes / ceiling); stock: first_fit + per-token path"
    )
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": served.rows_as_dicts(rows)}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _config(args: argparse.Namespace, **extra):
    from kvtier.bench.transfer import BenchConfig

    device = _device(args.device)
    cuda = device.type == "cuda"
    full = preset(args.spec or "deepseek-v3", args.page_size)
    layers = getattr(args, "layers", 1)
    if not 1 <= layers <= full.num_layers:
        raise SystemExit(f"--layers {layers} must be in [1, {full.num_layers}], the layers of {full.name}")
    spec = full.with_layers(layers)
    tokens = args.tokens or (131072 if cuda else 16384)
    if tokens <= 0 or tokens % spec.page_size:
        raise SystemExit(f"--tokens {tokens} must be a positive multiple of --page-size")
    return BenchConfig(
        spec=spec,
        tokens=tokens,
        layout=HostLayout(args.layout),
        device=device,
        repeats=args.repeats or (20 if cuda else 5),
        warmup=args.warmup,
        cycles=getattr(args, "cycles", 8),
        batch=args.batch,
        kernel=args.kernel or KernelOptions(),
        **extra,
    )


def _progress() -> tuple[Callable[[str], None], object]:
    if console.is_terminal:
        status = console.status("starting")
        return (lambda msg: status.update(msg)), status
    return (lambda msg: console.print(msg, highlight=False)), None


def _run_with_progress(fn):
    report, status = _progress()
    if status is None:
        return fn(report)
    with status:
        return fn(report)


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvtier.bench.transfer import rows_as_dicts, run

    directions = (
        (Direction.LOAD, Direction.BACKUP) if args.direction == "both" else (Direction(args.direction),)
    )
    cfg = _config(
        args,
        directions=directions,
        host_sets=args.host_sets,
        device_sets=args.device_sets,
        variants=args.variants,
        kernel_sweep=args.kernel_sweep,
        layers=args.layers,
    )
    rows, meta = _run_with_progress(lambda report: run(cfg, progress=report))

    where = meta.get("gpu") or meta.get("cpu")
    buffers = ", ".join(f"{n} {b} B" for n, b in meta["buffers"].items())
    title = (
        f"{meta['spec']} ({buffers}), {_layers_text(cfg.layers)} of {cfg.tokens} tokens "
        f"({meta['layer_bytes'] / 1e6:.0f} MB per call), "
        f"{cfg.layout.value}, page {cfg.spec.page_size}, on {where}; ceiling "
        + ", ".join(f"{d} {g} GB/s" for d, g in meta["ceiling_gbps"].items())
    )
    table = Table(title=title)
    cols = ("direction", "host slots", "runs", "device", "variant", "path", "SMs", "GB/s", "of ceiling", "ok")
    for col in cols:
        table.add_column(col, justify="right" if col in ("runs", "SMs", "GB/s", "of ceiling") else "left")
    for r in rows:
        variant = f"[bold]{r.variant}[/bold]" if r.planned else r.variant
        table.add_row(
            r.direction,
            r.host_runs,
            str(r.host_run_count),
            r.device,
            variant,
            r.path + (f" {r.kernel}" if r.kernel else ""),
            str(r.sms),
            f"{r.gbps:.1f}",
            f"{r.ceiling_ratio:.2f}",
            "yes" if r.identical else "[red]NO[/red]",
        )
    console.print(table)
    console.print(
        "planned: the path the planner picks; ok: byte-identical to the source, nothing else written"
    )
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows_as_dicts(rows)}, indent=1))
        console.print(f"wrote {args.json}")
    return 0 if all(r.identical for r in rows) else 1


def _layers_text(layers: int) -> str:
    return "one layer" if layers == 1 else f"{layers} layers per call"


def _bench_overlap(args: argparse.Namespace) -> int:
    from kvtier.bench import overlap
    from kvtier.bench.transfer import _metadata

    cfg = _config(args, host_sets=("contiguous",), device_sets=("contiguous",))
    if cfg.device.type != "cuda":
        console.print("[red]error:[/red] kvtier bench overlap needs a CUDA device")
        return 2
    log = args.rounds_log.open("w") if args.rounds_log else None

    def on_round(r: dict) -> None:
        log.write(json.dumps(r) + "\n")
        log.flush()

    try:
        rows, s = _run_with_progress(
            lambda report: overlap.run(cfg, report, rounds=args.rounds, on_round=on_round if log else None)
        )
    finally:
        if log is not None:
            log.close()
    meta = _metadata(cfg, s.ceilings, s.layer_bytes)
    table = Table(title=f"{meta['spec']}, {cfg.tokens} tokens per layer call, on {meta.get('gpu')}")
    for col in ("test", "mechanism", "SMs", "value", "against", "ratio"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r.test, r.mechanism, str(r.sms), f"{r.value:.1f} {r.unit}", f"{r.reference:.1f}", f"{r.ratio:.3f}"
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _bench_cache(args: argparse.Namespace) -> int:
    from kvtier.bench import cache as bc
    from kvtier.cache import WritePolicy

    device = _device(args.device)
    cuda = device.type == "cuda"
    spec = preset(args.spec or ("deepseek-v3" if cuda else "tiny-mla"), args.page_size)
    trace_spec = spec.with_layers(args.layers) if args.layers else spec
    policies = [w.value for w in WritePolicy] if args.policy == "all" else [args.policy]
    cfg = bc.TraceConfig(
        spec=trace_spec,
        device=device,
        device_slots=args.device_slots,
        host_slots=args.host_slots,
        conversations=args.conversations,
        turns=args.turns,
        active=args.active,
        seed=args.seed,
    )
    out: dict = {}

    def run(report: Callable[[str], None]) -> None:
        if "trace" in args.parts:
            pools = bc.build_pools(cfg)
            out["trace"] = [bc.run_trace(cfg, p, pools, report).row for p in policies]
            del pools
        if "alloc" in args.parts:
            out["alloc"] = bc.run_allocator(
                args.alloc_slots,
                args.page_size,
                args.alloc_churn,
                args.alloc_pairs,
                seed=args.seed,
                progress=report,
            )
        if "reload" in args.parts:
            out["reload"] = bc.run_prefix_reload(
                spec,
                args.reload_tokens,
                device,
                args.reload_repeats,
                seed=args.seed,
                progress=report,
                query_ids=args.reload_ids,
                host_runs=args.reload_host_runs,
                host_layout=args.reload_layout,
                layers_per_load=args.reload_layers_per_load,
            )

    _run_with_progress(run)
    meta = bc.metadata(
        cfg,
        policies,
        alloc={"slots": args.alloc_slots, "churn": args.alloc_churn, "pairs": args.alloc_pairs},
        reload={"spec": spec.name, "layers": spec.num_layers, "tokens": args.reload_tokens},
    )
    where = meta.get("gpu") or meta.get("cpu")
    bpt = trace_spec.bytes_per_token()

    if "trace" in out:
        table = Table(
            title=f"multi-turn trace: {trace_spec.name} x {trace_spec.num_layers} layers ({bpt} B/token), "
            f"page {trace_spec.page_size}, {cfg.device_slots} device / {cfg.host_slots} host slots, "
            f"{cfg.conversations} conversations x {cfg.turns} turns ({out['trace'][0].requests} requests), "
            f"on {where}"
        )
        table.add_column("policy", no_wrap=True)
        cols = ("device hit", "host hit", "miss", "H2D MB", "D2H MB", "backups", "evictions dev/host")
        cols += ("evicted tok", "dropped tok", "free runs host/dev", "s")
        for col in cols:
            table.add_column(col, justify="right")
        for r in out["trace"]:
            f = r.fragmentation
            table.add_row(
                r.policy,
                f"{r.device_hit:.3f}",
                f"{r.host_hit:.3f}",
                f"{r.miss:.3f}",
                f"{r.bytes_h2d / 1e6:.1f}",
                f"{r.bytes_d2h / 1e6:.1f}",
                str(r.backups),
                f"{r.device_evictions}/{r.host_evictions}",
                str(r.device_evicted_tokens),
                str(r.dropped_tokens),
                f"{f['host_free_runs']}/{f['device_free_runs']}",
                f"{r.seconds:.1f}",
            )
        console.print(table)
        ops = Table(title="host time per controller call, microseconds: median / p99 (calls)")
        ops.add_column("op")
        for r in out["trace"]:
            ops.add_column(r.policy, justify="right")
        for i, op in enumerate(bc.OPS):
            cells = [
                f"{s.median_us:.0f} / {s.p99_us:.0f} ({s.calls})" for s in (r.ops[i] for r in out["trace"])
            ]
            ops.add_row(op + (" (submit)" if op == "load_back" else ""), *cells)
        console.print(ops)

    if "alloc" in out:
        table = Table(
            title=f"HostSlotAllocator, {args.alloc_slots} slots, page {args.page_size}, "
            f"after {args.alloc_churn} random alloc/free of 1-4096 slots at ~90% full"
        )
        cols = (
            "policy",
            "occupancy",
            "free runs",
            "runs of 131072",
            "n",
            "median us",
            "p99 us",
            "target",
            "met",
        )
        for col in cols:
            table.add_column(col, justify="left" if col == "policy" else "right")
        for r in out["alloc"]:
            table.add_row(
                r.policy,
                f"{r.occupancy:.3f}",
                str(r.free_runs),
                "no room" if r.prefix_runs is None else str(r.prefix_runs),
                str(r.n),
                f"{r.median_us:.1f}",
                f"{r.p99_us:.1f}",
                f"<= {r.target_us:.0f}",
                "yes" if r.met else "[red]no[/red]",
            )
        console.print(table)

    if "reload" in out:
        r = out["reload"]

        def na(x, fmt="{:.2f}"):
            return "n/a" if x is None else fmt.format(x)

        table = Table(
            title=f"match + load_back of a {r.tokens}-token prefix from the host: {r.spec} x {r.layers} "
            f"layers, {r.loaded_bytes / 1e9:.3f} GB in {r.host_runs} host runs ({r.host_layout}, "
            f"{r.layers_per_load} layers per kernel load), {r.query_ids} ids, median of {r.repeats}, "
            f"on {where}"
        )
        cols = (
            "CPU us",
            "thread us",
            "wall us",
            "of which match",
            "CPU <= 1 ms",
            "reload ms",
            "first layer ms",
            "ceiling GB/s",
            "ideal ms",
            "ratio",
            "ratio <= 1.1",
        )
        for col in cols:
            table.add_column(col, justify="right")
        table.add_row(
            f"{r.cpu_us:.0f}",
            f"{r.thread_us:.0f}",
            f"{r.wall_us:.0f}",
            f"{r.match_us:.0f}",
            "yes" if r.cpu_met else "[red]no[/red]",
            na(r.reload_ms),
            na(r.first_layer_ms),
            na(r.ceiling_gbps, "{:.1f}"),
            na(r.ideal_ms),
            na(r.ratio, "{:.3f}"),
            "n/a" if r.ratio_met is None else ("yes" if r.ratio_met else "[red]no[/red]"),
        )
        console.print(table)
        console.print(
            "CPU: process time (all threads) of match + load_back submission; thread: the caller's alone; "
            "reload: load_back called until the last layer's signal fired; ideal: the loaded bytes at the "
            "ceiling (one pinned copy)"
        )

    if args.json:
        rows = {k: [asdict(x) for x in v] if isinstance(v, list) else asdict(v) for k, v in out.items()}
        args.json.write_text(json.dumps({"meta": meta, **rows}, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
