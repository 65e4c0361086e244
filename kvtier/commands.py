"""What the `kvtier` commands share: the console, progress, their device and engine, JSON out.

`kvtier.cli` parses the arguments, then calls one `command(args)` beside the command's
subject (`kvtier.engine.demo.command`, `kvtier.bench.transfer.command`, ...). Those
functions and this module are the only code that prints.
"""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console

from kvtier.errors import BackendUnavailableError, ConfigError

if TYPE_CHECKING:
    from kvtier.cache import CacheConfig
    from kvtier.cache.ranks import RankGroup
    from kvtier.engine import Engine
    from kvtier.storage.config import StorageConfig

# `--storage-*` flag -> the `StorageConfig` field it sets (`kvtier.cli._storage_flags`).
STORAGE_FIELDS = {
    "storage_write": "write",
    "storage_prefetch": "prefetch",
    "storage_prefetch_timeout": "timeout_base_s",
    "storage_min_tokens": "min_tokens",
    "storage_compression": "compression",
    "storage_size": "size_bytes",
    "storage_pool_size": "pool_size",
    "storage_ttl": "ttl_s",
    "storage_model": "model",
}

# Wide enough for the tables when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 140)


def device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a device; `BackendUnavailableError` for a CUDA device this
    process lacks (a refusal of the machine, not of the command line: exit code 1)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"--device {name}: no CUDA device is available (torch {torch.__version__})"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise BackendUnavailableError(f"--device {name}: this machine has {count} CUDA device(s)")
    return dev


def storage_config(args: Namespace, url: str | None = None) -> StorageConfig | None:
    """The storage tier `--storage` (else `url`) and the `--storage-*` flags give; None for no tier.

    A flag left out keeps `StorageConfig`'s default. `ConfigError` for a flag given without
    a URL, or for a value the config refuses.
    """
    from kvtier.storage.config import StorageConfig

    given = {flag: v for flag in STORAGE_FIELDS if (v := getattr(args, flag, None)) is not None}
    url = getattr(args, "storage", None) or url
    if url is None:
        if given:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            raise ConfigError(f"{flags} given without --storage: there is no storage tier to apply it to")
        return None
    return StorageConfig(url, **{STORAGE_FIELDS[flag]: v for flag, v in given.items()})


def cache_config(args: Namespace) -> CacheConfig:
    """The cache's config the serve flags give (`--write-policy`, `--host-alloc`)."""
    from kvtier.alloc import AllocPolicy
    from kvtier.cache import CacheConfig, WritePolicy

    return CacheConfig(
        write_policy=WritePolicy(args.write_policy), host_alloc_policy=AllocPolicy(args.host_alloc)
    )


def engine_sizes(args: Namespace) -> dict[str, int]:
    """The `Engine` sizes the serve and demo flags give: both pools, running requests, batched tokens."""
    return {
        "device_tokens": args.device_tokens,
        "host_tokens": args.host_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }


def engine_for(
    args: Namespace, loading: str, config: CacheConfig, ranks: RankGroup | None = None, **kw: Any
) -> tuple[torch.device, Engine]:
    """`--model` loaded on `--device` in `--dtype` (`loading` on the console meanwhile), and an engine.

    The engine takes the pool sizes, `--page-size`, `--max-num-seqs` and
    `--max-num-batched-tokens`, and `--chat-template` where given (`ConfigError`, the engine
    closed, for one that is not valid Jinja); `kw` goes to it too
    (`storage=storage_config(args)`, built before this call so that a bad flag is refused
    before the model loads). `ranks`: this process's tensor-parallel group (`--tp`), the
    model its shard.
    """
    from kvtier.engine import Engine
    from kvtier.engine.models import load_model

    dev = device(args.device)
    with console.status(loading):
        model, tokenizer = load_model(args.model, dev, args.dtype, ranks)
    engine = Engine(
        model, tokenizer, config=config, page_size=args.page_size, ranks=ranks, **engine_sizes(args), **kw
    )
    if args.chat_template is not None:
        try:
            engine.chat_template = args.chat_template
        except ConfigError:
            engine.close()
            raise
    return dev, engine


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """`Engine.summary()` as two lines for the console: the model and its KV, then the limits."""
    per_token = summary["kv_bytes_per_token"]
    per = f"{per_token / 1024:.1f} KiB" if per_token >= 1024 else f"{per_token} B"

    def pool(name: str) -> str:
        tokens, gb = summary[f"{name}_pool_tokens"], summary[f"{name}_pool_bytes"] / 1e9
        return f"{name} pool {tokens} tokens ({gb:.2f} GB)"

    return [
        f"{summary['model']}, {summary['dtype']} on {summary['device']}: {per} of KV per token; "
        f"{pool('device')}, {pool('host')}",
        f"up to {summary['max_num_seqs']} running requests and {summary['max_num_batched_tokens']} "
        f"batched tokens per step; pages of {summary['page_size']} tokens",
    ]


@contextmanager
def progress() -> Iterator[Callable[[str], None]]:
    """A reporter of one-line progress messages: a spinner's text on a terminal, else a line each."""
    if not console.is_terminal:
        yield lambda msg: console.print(msg, highlight=False)
        return
    with console.status("starting") as status:
        yield lambda msg: status.update(msg)


def write_json(path: Path | None, payload: dict) -> None:
    """Write a benchmark's `{"meta": ..., ...}` report to `path` (nothing when None) and say so."""
    if path is None:
        return
    path.write_text(json.dumps(payload, indent=1))
    console.print(f"wrote {path}")
