"""The `kvtier` command's arguments: `kvtier demo | serve | bench ...` (`kvtier.cli.bench_args`).

This module parses and checks; it runs nothing. Every flag is checked before any model or
pool is built, and every refusal is one line on stderr (`kvtier serve: error: ...`), never
a traceback. Exit codes: 2 for what the command line gets wrong (argparse's refusals, and
a `ConfigError` the command raises for a flag's value or a combination of flags), 1 for
what the machine or the files named refuse (any other `KVTierError`: no CUDA device, a
port in use, a checkpoint that does not load; a missing package). `main` calls the
function `COMMANDS` names (`module:function`), whose module is imported only when its
command runs: parsing imports neither torch nor transformers, so `kvtier --help` is
fast; the fixed values of flags are spelled out in `kvtier.cli.args`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvtier import __version__
from kvtier.cli.args import (
    ALLOC_POLICIES,
    COMPRESSIONS,
    DTYPES,
    LAYOUTS,
    PREFETCH_POLICIES,
    STORAGE_WRITES,
    WRITE_POLICIES,
    Parser,
    SubcommandParser,
    byte_size,
    chat_template_file,
    device_flag,
    model_flag,
    non_negative,
    non_negative_float,
    port,
    positive,
    positive_float,
    storage_url,
    write_policy_flag,
)
from kvtier.cli.bench_args import add_bench
from kvtier.errors import ConfigError, KVTierError
from kvtier.server.limits import API_KEY_ENV, SHUTDOWN_TIMEOUT_S, Limits

# The function `command(args) -> int` that runs each command, as `module:function`.
COMMANDS = {
    "demo": "kvtier.cli.demo:command",
    "serve": "kvtier.cli.serve:command",
    "bench transfer": "kvtier.cli.bench_transfer:bench_transfer",
    "bench overlap": "kvtier.cli.bench_transfer:bench_overlap",
    "bench cache": "kvtier.cli.bench_cache:command",
    "bench served": "kvtier.cli.bench_serving:bench_served",
    "bench storage": "kvtier.cli.bench_serving:bench_storage",
    "bench multiturn": "kvtier.cli.bench_serving:bench_multiturn",
    "bench batching": "kvtier.cli.bench_serving:bench_batching",
    "bench vllm": "kvtier.cli.bench_serving:bench_vllm",
}


def _model_flags(p: argparse.ArgumentParser, device_tokens: int, host_tokens: int | None, what: str) -> None:
    model_flag(p)
    p.add_argument(
        "--chat-template",
        type=chat_template_file,
        metavar="FILE",
        help="a Jinja chat template, used instead of the tokenizer's (default: the tokenizer's)",
    )
    device_flag(p)
    p.add_argument("--device-tokens", type=positive, default=device_tokens, help=what)
    p.add_argument(
        "--host-tokens",
        type=positive,
        default=host_tokens,
        help="host KV pool in tokens"
        + ("" if host_tokens else " (default: sized to this machine's available RAM, printed at start)"),
    )
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
        help="weights and KV pools; auto: bfloat16 on CUDA, float32 on the CPU",
    )
    p.add_argument("--max-num-seqs", type=positive, default=64, help="requests running at once")
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every decode step runs eagerly"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive,
        default=2048,
        help="tokens one forward computes over all running requests",
    )


def _storage_flags(p: argparse.ArgumentParser, default: str) -> None:
    """The storage tier's flags; each left None unless given, so `StorageConfig`'s defaults hold."""
    g = p.add_argument_group("storage tier (below the host; see kvtier.storage.config)")
    g.add_argument(
        "--storage",
        type=storage_url,
        metavar="URL",
        help="file://PATH, redis://HOST:PORT/DB, redis+cluster://H:P,H:P or MODULE:CLASS "
        f"(default: {default})",
    )
    g.add_argument(
        "--storage-write", choices=STORAGE_WRITES, help="when pages reach storage (default: write_through)"
    )
    g.add_argument(
        "--storage-prefetch",
        choices=PREFETCH_POLICIES,
        help="how long a request waits for pages from storage (default: timeout)",
    )
    g.add_argument(
        "--storage-prefetch-timeout",
        type=non_negative_float,
        metavar="SECONDS",
        help="the timeout policy's base wait, before its per-1k-token part (default: 2)",
    )
    g.add_argument(
        "--storage-min-tokens",
        type=non_negative,
        metavar="N",
        help="shorter storage hits are recomputed (default: 0)",
    )
    g.add_argument("--storage-compression", choices=COMPRESSIONS, help="page codec (default: none)")
    g.add_argument(
        "--storage-size", type=byte_size, metavar="BYTES", help="file:// cap, e.g. 10G (default: none)"
    )
    g.add_argument("--storage-pool-size", type=positive, metavar="N", help="redis connections (default: 16)")
    g.add_argument(
        "--storage-ttl", type=non_negative, metavar="SECONDS", help="redis key TTL (default: 0, none)"
    )
    g.add_argument(
        "--storage-model",
        metavar="NAME",
        help="the model identity page keys are namespaced by (default: the checkpoint's name or path)",
    )


def _serve(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible server over the tiered cache")
    _model_flags(s, 16384, None, "device KV pool in tokens")
    s.add_argument("--model-name", help="the name clients ask for (default: the checkpoint's folder name)")
    s.add_argument(
        "--tp",
        type=positive,
        default=1,
        metavar="N",
        help="tensor-parallel ranks: N processes, rank i on cuda:i (gloo on the CPU without CUDA); "
        "rank 0 serves HTTP",
    )
    write_policy_flag(s, WRITE_POLICIES, "write_through")
    s.add_argument("--host-layout", choices=LAYOUTS, default="layer_first", help="host pool layout")
    s.add_argument("--host-alloc", choices=ALLOC_POLICIES, default="contiguous", help="host allocator policy")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"requests must send `Authorization: Bearer KEY` (/health and /metrics stay open) "
        f"(default: ${API_KEY_ENV}, else no key)",
    )
    s.add_argument("--max-queue", type=positive, default=256, help="waiting requests before new ones get 429")
    s.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="a request running longer is answered 504",
    )
    s.add_argument(
        "--no-access-log",
        action="store_true",
        help="log no line per request (by default: method, path, status, tokens, TTFT, at INFO)",
    )
    s.add_argument(
        "--body-timeout",
        type=positive_float,
        default=Limits.body_timeout_s,
        metavar="SECONDS",
        help="a request body not wholly arrived this long after its headers is answered 408",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long requests in flight may run before they are cancelled",
    )
    s.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=16.0,
        metavar="MIB",
        help="larger request bodies are answered 413",
    )
    _storage_flags(s, "none, no third tier")


def _demo(sub) -> None:
    d = sub.add_parser("demo", help="multi-turn chats on a real model, earlier turns evicted and reloaded")
    _model_flags(d, 320, 16384, "device KV budget in tokens (small: forces reloads)")
    d.add_argument("--max-tokens", type=positive, default=32, help="tokens to generate per answer")
    write_policy_flag(d, WRITE_POLICIES, "write_through")
    _storage_flags(d, "the turns use none; the restart part a temporary file:// store")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it imports nothing heavy."""
    p = Parser(prog="kvtier", description="Hierarchical KV cache for LLM serving.")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    _serve(sub)
    _demo(sub)
    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, then run the command; its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    name = args.command if args.command != "bench" else f"bench {args.bench}"
    try:
        module, function = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), function)(args)
    except KVTierError as e:
        print(f"kvtier {name}: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line
        return 2 if isinstance(e, ConfigError) else 1
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "kvtier":
            raise
        extra = "bench" if e.name.split(".")[0] in ("matplotlib", "openai", "httpx") else "engine"
        print(f"kvtier {name}: error: needs {e.name} (pip install 'kvtier[{extra}]')", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvtier {name}: interrupted", file=sys.stderr)
        return 130
