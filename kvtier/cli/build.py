"""What a command's flags build: the device, the cache's config, the storage tier and the engine.

Every flag is checked here before anything is built (`storage_config` before the model
loads); a refusal is a `ConfigError` (exit 2) or, for what the machine lacks, another
`KVTierError` (exit 1).
"""

from __future__ import annotations

from argparse import Namespace
from typing import TYPE_CHECKING, Any

import torch

from kvtier.cli.console import console
from kvtier.errors import BackendUnavailableError, ConfigError

if TYPE_CHECKING:
    from kvtier.cache import CacheConfig
    from kvtier.cache.ranks import RankGroup
    from kvtier.engine import Engine
    from kvtier.storage.config import StorageConfig

# `--storage-*` flag -> the `StorageConfig` field it sets (`kvtier.cli.parser._storage_flags`).
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
