"""`kvtier bench`'s subcommands and their flags (transfer, overlap, served, cache, storage,
multiturn, batching, vllm); `add_bench(sub)` adds them under `kvtier bench`.

Like `kvtier.cli.parser`, this module parses and runs nothing: each benchmark's command
(`kvtier.cli.bench_*`, named in `kvtier.cli.parser.COMMANDS`) takes the parsed flags.
"""

from __future__ import annotations

import argparse
from argparse import ArgumentTypeError
from pathlib import Path

from kvtier.bench.transfer_sets import DEFAULT_VARIANTS, DEVICE_SETS, HOST_SETS, VARIANTS
from kvtier.cli.args import (
    BATCHING_PARTS,
    CACHE_PARTS,
    DIRECTIONS,
    DTYPES,
    ID_DTYPES,
    LAYOUTS,
    MULTITURN_CONFIGS,
    SETUPS,
    SHAPES,
    SPECS,
    STORAGE_BACKENDS,
    STORAGE_PARTS,
    STORAGE_SPECS,
    WRITE_POLICIES,
    csv_flag,
    csv_of,
    device_flag,
    json_flag,
    model_flag,
    non_negative,
    positive,
    positive_float,
    positive_list,
    write_policy_flag,
)

# The benchmarks `add_bench` adds, each run by its command in `kvtier.cli.parser.COMMANDS`.
BENCHES = ("transfer", "overlap", "cache", "served", "storage", "multiturn", "batching", "vllm")


def kernel_shape(text: str):
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


def kernel_shapes(text: str) -> tuple:
    return tuple(kernel_shape(x) for x in text.split(",") if x)


def token_counts(text: str) -> tuple[int, ...]:
    """A comma list of positive token counts."""
    try:
        out = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise ArgumentTypeError(f"{text!r} must be a comma list of positive token counts")
    return out


def _timing_flags(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The flags `bench transfer` and `bench overlap` share (`sweep`: several `--tokens` at once)."""
    p.add_argument("--spec", choices=SPECS, help="KV spec preset (default: deepseek-v3)")
    what = "prefix lengths, a comma list swept in one process" if sweep else "prefix length"
    p.add_argument(
        "--tokens",
        type=token_counts if sweep else positive,
        help=f"{what} (default: 131072 on CUDA, 16384 on CPU)",
    )
    p.add_argument("--page-size", type=positive, default=1, help="tokens per page")
    p.add_argument("--layout", choices=LAYOUTS, default="layer_first", help="host pool layout")
    device_flag(p)
    p.add_argument("--repeats", type=positive, help="timed repeats per row (default: 20 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=non_negative, default=2, help="untimed calls before each row")
    p.add_argument("--batch", type=positive, default=4, help="back-to-back calls per timed sample")
    p.add_argument(
        "--kernel",
        type=kernel_shape,
        help="gather kernel PROGRAMSxROWS, or PROGRAMS with rows by row size; then sSTAGES "
        "(default: 8 programs)",
    )
    json_flag(p)


def _bench_transfer(bench) -> None:
    t = bench.add_parser("transfer", help="host <-> device transfer paths at every fragmentation and size")
    _timing_flags(t, sweep=True)
    t.add_argument("--direction", choices=DIRECTIONS, default="both", help="the direction timed")
    t.add_argument("--cycles", type=non_negative, default=8, help="fill/evict cycles before the churn rows")
    csv_flag(t, "--host-sets", HOST_SETS, runs=True)
    csv_flag(t, "--device-sets", DEVICE_SETS)
    csv_flag(t, "--variants", VARIANTS, default=DEFAULT_VARIANTS)
    t.add_argument(
        "--kernel-sweep",
        type=kernel_shapes,
        default=(),
        help="extra kernel shapes timed on the fully scattered set, e.g. 4x32,8x64,8s1",
    )
    t.add_argument(
        "--host-slots",
        type=positive,
        help="slots of the host pool the sets are drawn from (default: 2 x --tokens)",
    )
    t.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs reloading at once, one process each on cuda:0..N-1 (the planned path; default: 1)",
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
    csv_flag(sv, "--setups", SETUPS)
    sv.add_argument(
        "--prefix", type=positive_list, help="prefix lengths (default: 8k-128k on CUDA, 256,1024 on CPU)"
    )
    device_flag(sv)
    sv.add_argument(
        "--cycles", type=non_negative, default=4, help="fill/evict cycles that fragment the host pool"
    )
    sv.add_argument("--repeats", type=positive, default=3, help="timed requests per row")
    sv.add_argument(
        "--layers", type=positive, help="cut every setup's model to this many layers (default: its own)"
    )
    json_flag(sv)


def _bench_cache(bench) -> None:
    c = bench.add_parser(
        "cache", help="the tiered prefix cache: a multi-turn trace, the allocator, a 128k reload"
    )
    c.add_argument(
        "--parts",
        type=csv_of(CACHE_PARTS),
        default=("trace", "alloc", "reload"),
        help=f"comma list of {','.join(CACHE_PARTS)}",
    )
    c.add_argument("--spec", choices=SPECS, help="KV spec (default: deepseek-v3 on CUDA, tiny-mla on CPU)")
    c.add_argument(
        "--layers", type=positive, help="cut the spec to this many layers (trace only; default: all)"
    )
    c.add_argument("--page-size", type=positive, default=1, help="tokens per page")
    device_flag(c)
    write_policy_flag(c, ("all", *WRITE_POLICIES), "all")
    c.add_argument("--device-slots", type=positive, default=65536, help="device pool of the trace (tokens)")
    c.add_argument("--host-slots", type=positive, default=262144, help="host pool of the trace (tokens)")
    c.add_argument("--conversations", type=positive, default=64, help="conversations of the trace")
    c.add_argument("--turns", type=positive, default=8, help="turns per conversation")
    c.add_argument("--active", type=positive, default=8, help="conversations in progress at once")
    c.add_argument("--alloc-slots", type=positive, default=4 * 1024 * 1024, help="allocator pool size")
    c.add_argument("--alloc-churn", type=non_negative, default=60_000, help="random alloc/free before timing")
    c.add_argument("--alloc-pairs", type=positive, default=2000, help="timed alloc + free pairs per size")
    c.add_argument("--reload-tokens", type=positive, default=131072, help="prefix length of the reload")
    c.add_argument("--reload-repeats", type=positive, default=5, help="timed reloads")
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
    c.add_argument("--evict-nodes", type=positive, default=100_000, help="nodes in the eviction part's tree")
    c.add_argument("--evict-k", type=positive, default=1000, help="nodes each eviction part's call evicts")
    c.add_argument("--seed", type=int, default=0, help="the trace's and the churn's seed")
    json_flag(c)


def _bench_storage(bench) -> None:
    st = bench.add_parser("storage", help="the storage tier: put/get beside raw stores, compression, TTFT")
    csv_flag(st, "--parts", STORAGE_PARTS)
    csv_flag(st, "--backends", STORAGE_BACKENDS)
    st.add_argument("--page-sizes", type=positive_list, default=(16, 64, 256), help="throughput page sizes")
    csv_flag(st, "--specs", STORAGE_SPECS)
    st.add_argument("--layout", choices=LAYOUTS, default="layer_first", help="host pool layout")
    st.add_argument(
        "--tokens", type=positive_list, help="TTFT prefixes (default: 2k-8k on CPU, 2k-32k on CUDA)"
    )
    st.add_argument(
        "--setup", choices=STORAGE_SPECS, help="TTFT model shape (default: deepseek-v3 on CUDA, else smollm2)"
    )
    st.add_argument("--dir", type=Path, help="where the stores go (default: the temporary directory)")
    st.add_argument("--redis", help="redis://HOST:PORT/DB to use (default: start a redis-server)")
    st.add_argument("--repeats", type=positive, help="timed samples per row (default: 3)")
    st.add_argument("--miss-repeats", type=positive, default=1, help="TTFT misses per prefix")
    st.add_argument("--drop-caches", action="store_true", help="drop the page cache before each read (root)")
    st.add_argument("--quick", action="store_true", help="smoke-test sizes")
    device_flag(st)
    json_flag(st)


def _engine_bench_flags(p: argparse.ArgumentParser) -> None:
    """The model and engine flags `bench multiturn` and `bench batching` share."""
    which = p.add_mutually_exclusive_group()
    model_flag(which)
    which.add_argument(
        "--shape", choices=SHAPES, help="random weights of this shape instead (llama-3.1-8b: the real KV)"
    )
    device_flag(p)
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="weights and KV; auto: bfloat16 on CUDA, else float32"
    )
    p.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="tokens per engine step")
    p.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    json_flag(p)


# How the configurations' order changes from repeat to repeat (kvtier.bench.multiturn.Order).
MULTITURN_ORDERS = ("fixed", "alternate", "rotate", "shuffle")


def _bench_multiturn(bench) -> None:
    m = bench.add_parser(
        "multiturn", help="N clients x M rounds of growing conversations: kvtier, device-only, no cache"
    )
    m.add_argument("--clients", type=positive, default=8, help="conversations at once")
    m.add_argument("--rounds", type=positive, default=4, help="rounds of each conversation")
    m.add_argument("--context-tokens", type=non_negative, default=0, help="random tokens before question 1")
    m.add_argument("--question-tokens", type=positive, default=128, help="tokens each round appends")
    m.add_argument(
        "--output-tokens",
        type=positive_list,
        help="tokens each answer has, a comma list: one table per length (default: 16)",
    )
    m.add_argument(
        "--request-rate", type=positive_float, help="rounds per second, Poisson (default: closed loop)"
    )
    m.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay this .csv/.jsonl of (arrival_s, conversation, input_tokens, output_tokens) rows "
        "instead (kvtier.bench.multiturn_trace)",
    )
    csv_flag(m, "--configs", MULTITURN_CONFIGS)
    m.add_argument("--repeats", type=positive, default=1, help="run the whole comparison this many times")
    m.add_argument(
        "--order",
        choices=MULTITURN_ORDERS,
        default="rotate",
        help="each repeat's order of --configs: fixed, alternate (reversed every other repeat), rotate "
        "(repeat r starts at the r-th), shuffle (seeded) (default: rotate)",
    )
    m.add_argument(
        "--no-warm-run",
        action="store_true",
        help="skip the untimed run of each table before its timed ones (where Triton compiles the "
        "kernels' variants the table needs: the first timed configuration pays for them instead)",
    )
    _engine_bench_flags(m)
    m.add_argument("--device-tokens", type=positive, default=1024, help="device KV pool in tokens")
    m.add_argument("--host-tokens", type=positive, default=65536, help="host KV pool of kvtier in tokens")
    m.add_argument("--page-size", type=positive, help="tokens per cache page (default: 1)")
    m.add_argument("--max-num-seqs", type=positive, default=64, help="running requests at most")
    m.add_argument(
        "--threads",
        type=positive,
        help="torch's CPU threads on --device cpu (default: half the cores, at least 1: on a busy machine, "
        "threads that wait for each other stall each step; bench/FINDINGS.md)",
    )
    m.add_argument(
        "--plot", type=Path, metavar="PNG", help="write TTFT per round and hit tokens per tier to this PNG"
    )
    m.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="run nothing: show (and --plot the first) reports written before; with several, whether "
        "their figures agree; --json keeps them all in one file",
    )


def _bench_batching(bench) -> None:
    b = bench.add_parser("batching", help="K requests at once against one by one; decode rate by batch size")
    csv_flag(b, "--parts", BATCHING_PARTS)
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
    b.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")


def _bench_vllm(bench) -> None:
    v = bench.add_parser(
        "vllm", help="TTFT of a vLLM server with kvtier's connector: host hit, storage hit, miss"
    )
    v.add_argument(
        "--vllm-python", metavar="PATH", help="a venv's python with vLLM (default: $KVTIER_VLLM_PYTHON)"
    )
    model_flag(v)
    v.add_argument(
        "--tokens",
        type=positive_list,
        default=(1024, 2048, 4096, 8192),
        help="prompt lengths (default: 1024,2048,4096,8192)",
    )
    v.add_argument(
        "--repeats", type=positive, default=3, help="timed requests per case and length (default: 3)"
    )
    v.add_argument(
        "--max-tokens", type=positive, default=8, help="tokens of each (greedy) answer (default: 8)"
    )
    v.add_argument(
        "--host-gb", type=positive_float, default=1.0, help="the connector's host pool, GiB (default: 1)"
    )
    v.add_argument("--store", type=Path, help="the file store's folder (default: a temporary one)")
    v.add_argument(
        "--dtype",
        choices=DTYPES[1:],
        default="bfloat16",
        help="both servers' weights and KV (default: bfloat16)",
    )
    v.add_argument("--no-kvtier-server", action="store_true", help="skip kvtier's own server")
    v.add_argument(
        "--vllm-arg",
        action="append",
        metavar="ARG",
        help="passed to vLLM's server (default: --enforce-eager)",
    )
    json_flag(v)


def add_bench(sub) -> None:
    """`kvtier bench` and its subcommands under `sub` (the subparsers of `kvtier`)."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _bench_transfer(bench)
    _bench_overlap(bench)
    _bench_served(bench)
    _bench_cache(bench)
    _bench_storage(bench)
    _bench_multiturn(bench)
    _bench_batching(bench)
    _bench_vllm(bench)
