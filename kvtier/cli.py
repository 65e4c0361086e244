"""The `kvtier` command's arguments: `kvtier demo | serve | bench` (transfer, overlap, cache, served,
storage, multiturn, batching)

This module parses and checks; it runs nothing. Every flag is checked before any model or
pool is built: a bad value is argparse's usage line on stderr and exit code 2. `main` then
calls `command(args)` in the module `COMMANDS` names; a `KVTierError` it raises is one line
on stderr and exit code 2 as well. Parsing imports neither torch nor transformers, so
`kvtier --help` is fast and the choices are spelled out here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from argparse import ArgumentTypeError
from pathlib import Path

from kvtier.errors import KVTierError

# Module whose `command(args) -> int` runs each command.
COMMANDS = {"demo": "kvtier.engine.demo", "serve": "kvtier.engine.server"} | {
    f"bench {b}": f"kvtier.bench.{b}"
    for b in ("transfer", "overlap", "cache", "served", "storage", "multiturn", "batching")
}

# The fixed values of flags, each checked by tests/test_cli.py against what its comment names.
SPECS = (  # sorted(kvtier.spec.PRESETS)
    *("deepseek-v3", "deepseek-v3-fp8", "deepseek-v3-fp8-packed", "glm-5", "glm-5-fp8", "glm-5-indexer"),
    *("llama-3.1-8b", "tiny-dsa", "tiny-mha", "tiny-mha-fp16", "tiny-mla", "tiny-mla-fp8"),
)
LAYOUTS = ("layer_first", "page_first")  # kvtier.pool.HostLayout
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # kvtier.cache.WritePolicy
ALLOC_POLICIES = ("contiguous", "first_fit")  # kvtier.alloc.AllocPolicy
DIRECTIONS = ("load", "backup", "both")  # kvtier.pool.device.Direction, or both
# kvtier.bench.transfer.HOST_SETS and VARIANTS
HOST_SETS = ("contiguous", "runs-256", "runs-64", "runs-16", "runs-1", "contiguous-churn", "first_fit-churn")
VARIANTS = ("planned", "single_copy", "batched_dma", "per_run", "staged", "kernel", "stock", "reference")
DEVICE_SETS = ("contiguous", "scattered")
STORAGE_PARTS = ("throughput", "compression", "ttft")  # kvtier.bench.storage.Part
STORAGE_BACKENDS = ("file", "redis")  # kvtier.bench.storage.BACKENDS
SETUPS = ("smollm2", "deepseek-v3")  # kvtier.bench.served.SETUPS
CACHE_PARTS = ("trace", "alloc", "reload", "eviction")
STORAGE_WRITES = ("write_through", "write_back")  # kvtier.storage.config.StorageWrite
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # kvtier.storage.config.PrefetchPolicy
COMPRESSIONS = ("none", "lz4", "zstd")  # kvtier.storage.config.Compression
ID_DTYPES = ("int32", "int64")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto, then kvtier.engine.models.DTYPES
MULTITURN_CONFIGS = ("kvtier", "device-only", "no-cache")  # kvtier.bench.multiturn.CONFIGS
SHAPES = ("tiny", "llama-3.1-8b")  # kvtier.bench.engines.SHAPES
BATCHING_PARTS = ("concurrent", "decode")  # kvtier.bench.batching.PARTS

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# The forms `kvtier.storage.backend.open_backend` takes; the rest of a URL is checked when it opens.
_STORAGE_URL = re.compile(r"file://.+|redis://.+|redis\+cluster://.+|[A-Za-z_][\w.]*:[A-Za-z_]\w*(\?.*)?")
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(i?B)?", re.IGNORECASE)


def positive(text: str) -> int:
    """An integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative(text: str) -> int:
    """An integer of at least 0."""
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise ArgumentTypeError(f"expected {what}, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """Bytes: an integer with an optional binary suffix K, M, G or T (`512M`, `10G`, `10GiB`)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ArgumentTypeError(f"expected a size in bytes such as 1073741824, 512M or 10G, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def storage_url(text: str) -> str:
    """`file://PATH`, `redis://HOST:PORT[/DB]`, `redis+cluster://HOST:PORT[,...]` or `MODULE:CLASS`."""
    if not _STORAGE_URL.fullmatch(text):
        raise ArgumentTypeError(
            f"expected file://PATH, redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...] "
            f"or MODULE:CLASS, got {text!r}"
        )
    return text


def port(text: str) -> int:
    value = positive(text)
    if value > 65535:
        raise ArgumentTypeError(f"expected a port in [1, 65535], got {value}")
    return value


def device_name(text: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (whether CUDA is there is checked when the command starts)."""
    if not _DEVICE.fullmatch(text):
        raise ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def csv_of(choices: tuple[str, ...]):
    """A comma list whose every item is one of `choices`, as a tuple."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x for x in text.split(",") if x)
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise ArgumentTypeError(
                f"invalid choice(s) {', '.join(bad) or repr(text)} (choose from {', '.join(choices)})"
            )
        return items

    return parse


def positive_list(text: str) -> tuple[int, ...]:
    """A comma list of positive integers, as a tuple."""
    items = tuple(positive(x) for x in text.split(",") if x)
    if not items:
        raise ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return items


def _kernel_shape(text: str):
    """`PROGRAMSxROWS` (8x32), or `PROGRAMS` alone (4) for rows chosen by row size and budget;
    either followed by `sSTAGES` (8s1, 8x32s2) for the tiles each program keeps in flight."""
    shape, sep, stages = text.lower().partition("s")
    try:
        sm, *rows = (int(x) for x in shape.split("x"))
        depth = int(stages) if sep else None
    except ValueError:
        raise ArgumentTypeError(f"expected PROGRAMSxROWS such as 8x32 or 8x32s2, got {text!r}") from None
    if len(rows) > 1 or min(sm, *rows, 1 if depth is None else depth) < 1:
        raise ArgumentTypeError(f"kernel shape {text!r} must be one or two positive numbers")
    from kvtier.transfer import KernelOptions  # only when the flag is given: --help stays torch-free

    return KernelOptions(sm_budget=sm, rows_per_program=rows[0] if rows else None, stages=depth)


def _kernel_shapes(text: str) -> tuple:
    return tuple(_kernel_shape(x) for x in text.split(",") if x)


def _device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_name, default="auto", help="cuda, cuda:N, cpu or auto")


def _write_policy_flag(p: argparse.ArgumentParser, choices: tuple[str, ...], default: str) -> None:
    p.add_argument("--write-policy", choices=choices, default=default, help=f"{', '.join(choices)}")
    # The demo's and the cache bench's former name, kept working but not shown.
    p.add_argument(
        "--policy", dest="write_policy", choices=choices, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def _csv_flag(p: argparse.ArgumentParser, flag: str, choices: tuple[str, ...]) -> None:
    """A comma list of `choices`, all of them by default."""
    p.add_argument(flag, type=csv_of(choices), default=choices, help=f"comma list of {','.join(choices)}")


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, help="also write the rows and metadata to this file")


def _model_flags(p: argparse.ArgumentParser, device_tokens: int, host_tokens: int, what: str) -> None:
    p.add_argument("--model", help="a local transformers checkpoint (default: SmolLM2-135M-Instruct)")
    _device_flag(p)
    p.add_argument("--device-tokens", type=positive, default=device_tokens, help=what)
    p.add_argument("--host-tokens", type=positive, default=host_tokens, help="host KV pool in tokens")
    p.add_argument(
        "--page-size",
        type=positive,
        default=None,
        help="tokens per cache page (default: 1, or 64 with --storage: one storage value per page)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and KV pools: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, float16",
    )
    p.add_argument("--max-num-seqs", type=positive, default=64, help="requests running at once (default 64)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive,
        default=2048,
        help="tokens one forward computes over all running requests (default 2048)",
    )


def _storage_flags(p: argparse.ArgumentParser, default: str) -> None:
    """The storage tier's flags; each left None unless given, so `StorageConfig`'s defaults hold."""
    g = p.add_argument_group("storage tier (below the host; see kvtier.storage.config)")
    g.add_argument(
        "--storage",
        type=storage_url,
        metavar="URL",
        help=f"file://PATH, redis://HOST:PORT/DB, redis+cluster://H:P,H:P or MODULE:CLASS ({default})",
    )
    g.add_argument("--storage-write", choices=STORAGE_WRITES, help="write_through (default) or write_back")
    g.add_argument(
        "--storage-prefetch",
        choices=PREFETCH_POLICIES,
        help="how long a request waits for pages from storage: best_effort, wait_complete, timeout (default)",
    )
    g.add_argument(
        "--storage-prefetch-timeout",
        type=non_negative_float,
        metavar="SECONDS",
        help="the timeout policy's base wait, before its per-1k-token part (default 2)",
    )
    g.add_argument(
        "--storage-min-tokens", type=non_negative, metavar="N", help="shorter storage hits are recomputed"
    )
    g.add_argument("--storage-compression", choices=COMPRESSIONS, help="none (default), lz4 or zstd")
    g.add_argument(
        "--storage-size", type=byte_size, metavar="BYTES", help="file:// cap, e.g. 10G (default: none)"
    )
    g.add_argument("--storage-pool-size", type=positive, metavar="N", help="redis connections (default 16)")
    g.add_argument(
        "--storage-ttl", type=non_negative, metavar="SECONDS", help="redis key TTL (default 0: none)"
    )
    g.add_argument(
        "--storage-model",
        metavar="NAME",
        help="the model identity page keys are namespaced by (default: the checkpoint's name or path)",
    )


def _serve(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible server over the tiered cache")
    _model_flags(s, 16384, 131072, "device KV pool in tokens")
    s.add_argument("--model-name", help="the name clients ask for (default: the checkpoint's folder name)")
    _write_policy_flag(s, WRITE_POLICIES, "write_through")
    s.add_argument("--host-layout", choices=LAYOUTS, default="layer_first", help="host pool layout")
    s.add_argument("--host-alloc", choices=ALLOC_POLICIES, default="contiguous", help="host allocator policy")
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=port, default=8000)
    s.add_argument(
        "--max-queue",
        type=positive,
        default=256,
        help="waiting requests before new ones get 429 (default 256)",
    )
    s.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="a request running longer is answered 504 (default 600)",
    )
    s.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=16.0,
        metavar="MIB",
        help="larger request bodies are answered 413 (default 16)",
    )
    _storage_flags(s, "default: none, no third tier")


def _demo(sub) -> None:
    d = sub.add_parser("demo", help="multi-turn chats on a real model, earlier turns evicted and reloaded")
    _model_flags(d, 320, 16384, "device KV budget in tokens (small: forces reloads)")
    d.add_argument("--max-tokens", type=positive, default=32, help="tokens to generate per answer")
    _write_policy_flag(d, WRITE_POLICIES, "write_through")
    _storage_flags(d, "default: the turns use none; the restart part a temporary file:// store")


def _timing_flags(p: argparse.ArgumentParser) -> None:
    """The flags `bench transfer` and `bench overlap` share."""
    p.add_argument("--spec", choices=SPECS, help="KV spec preset (default: deepseek-v3)")
    p.add_argument("--tokens", type=positive, help="prefix length (default: 131072 on CUDA, 16384 on CPU)")
    p.add_argument("--page-size", type=positive, default=1)
    p.add_argument("--layout", choices=LAYOUTS, default="layer_first")
    _device_flag(p)
    p.add_argument("--repeats", type=positive, help="timed repeats per row (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=non_negative, default=2)
    p.add_argument("--batch", type=positive, default=4, help="back-to-back calls per timed sample")
    p.add_argument(
        "--kernel",
        type=_kernel_shape,
        help="gather kernel PROGRAMSxROWS, or PROGRAMS with rows by row size (default 8); then sSTAGES",
    )
    _json_flag(p)


def _bench_transfer(bench) -> None:
    t = bench.add_parser("transfer", help="host <-> device transfer paths at every fragmentation")
    _timing_flags(t)
    t.add_argument("--direction", choices=DIRECTIONS, default="both")
    t.add_argument("--cycles", type=non_negative, default=8, help="fill/evict cycles before the churn rows")
    _csv_flag(t, "--host-sets", HOST_SETS)
    _csv_flag(t, "--device-sets", DEVICE_SETS)
    _csv_flag(t, "--variants", VARIANTS)
    t.add_argument(
        "--kernel-sweep",
        type=_kernel_shapes,
        default=(),
        help="extra kernel shapes timed on the fully scattered set, e.g. 4x32,8x64,8s1",
    )
    t.add_argument(
        "--layers",
        type=positive,
        default=1,
        help="layers each timed call moves (page_first kernel rows then move in layer groups)",
    )


def _bench_overlap(bench) -> None:
    o = bench.add_parser("overlap", help="reload and backup at once; a matmul beside a reload (CUDA)")
    _timing_flags(o)
    o.add_argument(
        "--rounds", type=positive, default=5, help="alternating rounds with and without the reload"
    )
    o.add_argument(
        "--rounds-log", type=Path, help="write each interference round (host times, rates) as a JSON line"
    )


def _bench_served(bench) -> None:
    sv = bench.add_parser("served", help="TTFT of a miss, a device hit and a host hit, kvtier vs stock")
    _csv_flag(sv, "--setups", SETUPS)
    sv.add_argument(
        "--prefix", type=positive_list, help="prefix lengths (default: 8k-128k on CUDA, 256,1024 on CPU)"
    )
    _device_flag(sv)
    sv.add_argument(
        "--cycles", type=non_negative, default=4, help="fill/evict cycles that fragment the host pool"
    )
    sv.add_argument("--repeats", type=positive, default=3)
    _json_flag(sv)


def _bench_cache(bench) -> None:
    c = bench.add_parser(
        "cache", help="the tiered prefix cache: a multi-turn trace, the allocator, a 128k reload"
    )
    c.add_argument(
        "--parts",
        type=csv_of(CACHE_PARTS),
        default=("trace", "alloc", "reload"),
        help=f"comma list of {','.join(CACHE_PARTS)} (default: trace,alloc,reload)",
    )
    c.add_argument("--spec", choices=SPECS, help="KV spec (default: deepseek-v3 on CUDA, tiny-mla on CPU)")
    c.add_argument(
        "--layers", type=positive, help="cut the spec to this many layers (trace only; default: all)"
    )
    c.add_argument("--page-size", type=positive, default=1)
    _device_flag(c)
    _write_policy_flag(c, ("all", *WRITE_POLICIES), "all")
    c.add_argument("--device-slots", type=positive, default=65536, help="device pool of the trace (tokens)")
    c.add_argument("--host-slots", type=positive, default=262144, help="host pool of the trace (tokens)")
    c.add_argument("--conversations", type=positive, default=64)
    c.add_argument("--turns", type=positive, default=8, help="turns per conversation")
    c.add_argument("--active", type=positive, default=8, help="conversations in progress at once")
    c.add_argument("--alloc-slots", type=positive, default=4 * 1024 * 1024, help="allocator pool size")
    c.add_argument("--alloc-churn", type=non_negative, default=60_000, help="random alloc/free before timing")
    c.add_argument("--alloc-pairs", type=positive, default=2000, help="timed alloc + free pairs per size")
    c.add_argument("--reload-tokens", type=positive, default=131072, help="prefix length of the reload")
    c.add_argument("--reload-repeats", type=positive, default=5)
    c.add_argument(
        "--reload-host-runs",
        type=positive,
        default=1,
        help="runs the prefix's host copy lies in (as after churn)",
    )
    c.add_argument("--reload-ids", choices=ID_DTYPES, default="int32", help="dtype of the ids given to match")
    c.add_argument(
        "--reload-layout", choices=LAYOUTS, default="layer_first", help="host layout of the reload's pool"
    )
    c.add_argument(
        "--reload-layers-per-load",
        type=positive,
        default=1,
        help="layers a kernel reload moves per launch (page_first: layer groups)",
    )
    c.add_argument("--evict-nodes", type=positive, default=100_000, help="nodes in the eviction part's tree")
    c.add_argument("--evict-k", type=positive, default=1000, help="nodes each eviction part's call evicts")
    c.add_argument("--seed", type=int, default=0)
    _json_flag(c)


def _bench_storage(bench) -> None:
    st = bench.add_parser("storage", help="the storage tier: put/get beside raw stores, compression, TTFT")
    _csv_flag(st, "--parts", STORAGE_PARTS)
    _csv_flag(st, "--backends", STORAGE_BACKENDS)
    st.add_argument("--page-sizes", type=positive_list, default=(16, 64, 256), help="throughput page sizes")
    _csv_flag(st, "--specs", SETUPS)
    st.add_argument("--layout", choices=LAYOUTS, default="layer_first", help="host pool layout")
    st.add_argument(
        "--tokens", type=positive_list, help="TTFT prefixes (default: 2k-8k on CPU, 2k-32k on CUDA)"
    )
    st.add_argument(
        "--setup", choices=SETUPS, help="TTFT model shape (default: deepseek-v3 on CUDA, else smollm2)"
    )
    st.add_argument("--dir", type=Path, help="where the stores go (default: the temporary directory)")
    st.add_argument("--redis", help="redis://HOST:PORT/DB to use (default: start a redis-server)")
    st.add_argument("--repeats", type=positive, help="timed samples per row (default 3)")
    st.add_argument("--miss-repeats", type=positive, default=1, help="TTFT misses per prefix")
    st.add_argument("--drop-caches", action="store_true", help="drop the page cache before each read (root)")
    st.add_argument("--quick", action="store_true", help="smoke-test sizes")
    _device_flag(st)
    _json_flag(st)


def _engine_bench_flags(p: argparse.ArgumentParser) -> None:
    """The model and engine flags `bench multiturn` and `bench batching` share."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", help="a local transformers checkpoint (default: SmolLM2-135M-Instruct)")
    which.add_argument(
        "--shape", choices=SHAPES, help="random weights of this shape instead (llama-3.1-8b: the real KV)"
    )
    _device_flag(p)
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, else float32")
    p.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="tokens per engine step")
    p.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    _json_flag(p)


def _bench_multiturn(bench) -> None:
    m = bench.add_parser(
        "multiturn", help="N clients x M rounds of growing conversations: kvtier, device-only, no cache"
    )
    m.add_argument("--clients", type=positive, default=8)
    m.add_argument("--rounds", type=positive, default=4)
    m.add_argument("--context-tokens", type=non_negative, default=0, help="random tokens before question 1")
    m.add_argument("--question-tokens", type=positive, default=128, help="tokens each round appends")
    m.add_argument("--output-tokens", type=positive, default=16, help="tokens each answer has")
    m.add_argument(
        "--request-rate", type=positive_float, help="rounds per second, Poisson (default: closed loop)"
    )
    _csv_flag(m, "--configs", MULTITURN_CONFIGS)
    _engine_bench_flags(m)
    m.add_argument("--device-tokens", type=positive, default=1024, help="device KV pool in tokens")
    m.add_argument("--host-tokens", type=positive, default=65536, help="host KV pool of kvtier in tokens")
    m.add_argument("--page-size", type=positive, help="tokens per cache page (default 1)")
    m.add_argument("--max-num-seqs", type=positive, default=64, help="running requests at most")
    m.add_argument("--plot", type=Path, help="write TTFT per round and hit tokens per tier to this PNG")
    m.add_argument(
        "--from-json", type=Path, metavar="FILE", help="run nothing: show and --plot a report written before"
    )


def _bench_batching(bench) -> None:
    b = bench.add_parser("batching", help="K requests at once against one by one; decode rate by batch size")
    _csv_flag(b, "--parts", BATCHING_PARTS)
    b.add_argument("--concurrent", type=positive, default=6, help="requests submitted at once")
    b.add_argument("--prompt-tokens", type=positive, default=128, help="prompt of each concurrent request")
    b.add_argument("--output-tokens", type=positive, default=64, help="answer of each concurrent request")
    b.add_argument(
        "--running", type=positive_list, default=(1, 8, 32, 64), help="requests decoding at once, per row"
    )
    b.add_argument("--decode-prompt-tokens", type=positive, default=32, help="prompt of each decode request")
    b.add_argument("--steps", type=positive, default=16, help="timed decode steps per row")
    _engine_bench_flags(b)
    b.add_argument("--device-tokens", type=positive, help="device KV pool (default: what the parts need)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it imports nothing heavy."""
    p = argparse.ArgumentParser(prog="kvtier", description="Hierarchical KV cache for LLM serving.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    _serve(sub)
    _demo(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _bench_transfer(bench)
    _bench_overlap(bench)
    _bench_served(bench)
    _bench_cache(bench)
    _bench_storage(bench)
    _bench_multiturn(bench)
    _bench_batching(bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, then run the command; its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    name = args.command if args.command != "bench" else f"bench {args.bench}"
    try:
        return importlib.import_module(COMMANDS[name]).command(args)
    except KVTierError as e:
        print(f"kvtier {name}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "kvtier":
            raise
        extra = "bench" if e.name.split(".")[0] == "matplotlib" else "engine"
        print(f"kvtier {name}: error: needs {e.name} (pip install 'kvtier[{extra}]')", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtier {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
