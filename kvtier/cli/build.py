"""What a command's flags build: the device, the cache's config, the storage tier and the engine.

Every flag is checked here before anything is built (`storage_config` before the model
loads); a refusal is a `ConfigError` (exit 2) or, for what the machine lacks, another
`KVTierError` (exit 1).
"""

from __future__ import annotations

import math
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
    a URL, or for a value the config refuses; a `file://` directory that cannot be made or
    written is refused here too (`kvtier.storage.backend.check_url`).
    """
    from kvtier.storage.backend import check_url
    from kvtier.storage.config import StorageConfig

    given = {flag: v for flag in STORAGE_FIELDS if (v := getattr(args, flag, None)) is not None}
    url = getattr(args, "storage", None) or url
    if url is None:
        if given:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            raise ConfigError(f"{flags} given without --storage: there is no storage tier to apply it to")
        return None
    config = StorageConfig(url, **{STORAGE_FIELDS[flag]: v for flag, v in given.items()})
    check_url(config.url)  # a directory that cannot be written: refused before the model loads
    return config


def cache_config(args: Namespace) -> CacheConfig:
    """The cache's config the serve flags give (`--write-policy`, `--host-alloc`)."""
    from kvtier.alloc import AllocPolicy
    from kvtier.cache import CacheConfig, WritePolicy

    return CacheConfig(
        write_policy=WritePolicy(args.write_policy), host_alloc_policy=AllocPolicy(args.host_alloc)
    )


def engine_sizes(args: Namespace) -> dict[str, Any]:
    """The `Engine` sizes the serve and demo flags give: both pools, running requests, batched tokens
    (and `--enforce-eager`)."""
    return {
        "device_tokens": args.device_tokens,
        "host_tokens": args.host_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": getattr(args, "enforce_eager", False),
    }


# `kvtier serve`'s host pool without --host-tokens: at most this many tokens, and at most this share
# of the RAM available at start (on the GPU, where pinned host memory is the tier's point, a quarter;
# on the CPU, where both pools are RAM, a tenth and at most twice the device pool).
HOST_TOKENS_CAP = 131072
HOST_SHARE = {"cuda": 0.25, "cpu": 0.10}


def default_host_tokens(
    per_token: int, device_tokens: int, device_type: str, page_size: int, available: int
) -> tuple[int, str]:
    """The host pool's tokens when `--host-tokens` is left out, and why, in words.

    `per_token`: KV bytes per token; `available`: bytes of RAM available now. A multiple of
    the page size (and of 64, so a storage tier's pages fit), at least one page.
    """
    share = HOST_SHARE.get(device_type, HOST_SHARE["cpu"])
    cap = HOST_TOKENS_CAP if device_type == "cuda" else min(HOST_TOKENS_CAP, 2 * device_tokens)
    step = math.lcm(page_size, 64)
    tokens = max(step, min(cap, int(available * share) // per_token) // step * step)
    why = f"at most {share:.0%} of the {available / 1e9:.1f} GB of RAM available and {cap} tokens"
    return tokens, why


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
    from kvtier.engine.models import load_model, needs_conversion

    dev = device(args.device)
    if needs_conversion(args.model):  # with --tp, `rank_zero` has converted it before the ranks start
        console.print(
            "first run: converting SmolLM2-135M-Instruct from its GGUF file to a bf16 copy in the kvtier "
            "cache (once, about 15 s)",
            highlight=False,
        )
    with console.status(loading):
        model, tokenizer = load_model(args.model, dev, args.dtype, ranks)
    sizes, sized = engine_sizes(args), None
    if sizes["host_tokens"] is None:
        sizes["host_tokens"], sized = _sized_host_pool(args, model, dev, kw.get("storage"), ranks)
    engine = Engine(model, tokenizer, config=config, page_size=args.page_size, ranks=ranks, **sizes, **kw)
    if args.chat_template is not None:
        try:
            engine.chat_template = args.chat_template
        except ConfigError:
            engine.close()
            raise
    if sized is not None:
        console.print(sized, highlight=False)
    return dev, engine


def _sized_host_pool(
    args: Namespace, model: Any, dev: torch.device, storage: Any, ranks: Any
) -> tuple[int, str]:
    """`default_host_tokens` for `model` on this machine, and the line that says so."""
    from kvtier.engine.engine import STORAGE_PAGE_SIZE
    from kvtier.engine.hf import spec_from_hf_config
    from kvtier.pool.memory import host_memory_bytes

    page = args.page_size or (STORAGE_PAGE_SIZE if storage is not None else 1)
    world = ranks.world if ranks is not None else 1
    dtype = next(model.parameters()).dtype
    per_token = spec_from_hf_config(model.config, dtype=dtype, page_size=page, tp=world).bytes_per_token()
    tokens, why = default_host_tokens(per_token, args.device_tokens, dev.type, page, host_memory_bytes()[0])
    gb = tokens * per_token / 1e9
    return (
        tokens,
        f"host pool sized to this machine: {tokens} tokens ({gb:.2f} GB), {why} (--host-tokens N to choose)",
    )
