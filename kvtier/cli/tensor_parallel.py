"""The ranks of `kvtier serve --tp N`: N processes, rank 0 this one (it serves HTTP), the others followers.

`rank_zero(args)` refuses what cannot run before anything loads: `ConfigError` (exit 2)
for `--device cuda:N` (rank i takes `cuda:i`), `--device cpu` on a machine with CUDA
(transformers shards onto the accelerator), a checkpoint transformers has no
tensor-parallel plan for, or heads that `--tp` does not divide; `BackendUnavailableError`
(exit 1) for more ranks than CUDA devices. Without CUDA the ranks run on the CPU over gloo.

`Ranks(args)` (a context manager) starts the followers (`spawn`, one process per rank,
`cuda:i` and nccl with CUDA, the CPU and gloo without; a rank on a GPU binds its CPUs to the
GPU's NUMA node, where the machine shows one, before its pools are pinned), joins the
process group as rank 0 and yields its `RankGroup`; every follower loads its shard, builds the same engine and
replays rank 0's calls (`Engine.follow`) until rank 0's engine closes. Leaving the
block waits for the followers to end, and stops those that do not within `JOIN_S`.
A follower that fails ends with exit code 1 after logging why; rank 0 then fails at
its next collective.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
from argparse import Namespace
from datetime import timedelta
from typing import Any

import torch

from kvtier.cache.ranks import RankGroup
from kvtier.errors import BackendUnavailableError, ConfigError
from kvtier.pool.numa import bind_to_node

log = logging.getLogger(__name__)

# How long rank 0 waits for its followers to end once its engine has closed.
JOIN_S = 30.0
# How long the ranks wait for one another to start and load.
START_TIMEOUT = timedelta(minutes=10)


def rank_zero(args: Namespace) -> Namespace:
    """`args` for rank 0 (`--model` its checkpoint folder, `--device` rank 0's), once `--tp` and
    `--device` are found to fit this machine and the checkpoint."""
    from kvtier.engine.models import checkpoint_folder, tp_config

    n, name = args.tp, args.device
    if name.startswith("cuda:"):
        raise ConfigError(f"--device {name} with --tp {n}: rank i runs on cuda:i; give --device cuda or auto")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise BackendUnavailableError(
            f"--device cuda: no CUDA device is available (torch {torch.__version__})"
        )
    if name == "cpu" and cuda:
        raise ConfigError(
            f"--device cpu with --tp {n}: transformers puts the shards on this machine's CUDA devices"
        )
    if cuda and torch.cuda.device_count() < n:
        raise BackendUnavailableError(
            f"--tp {n}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    folder = checkpoint_folder(args.model)
    tp_config(folder, n)  # no plan, or heads that do not divide: refused here
    mine = copy.copy(args)
    mine.model, mine.device = str(folder), "cuda:0" if cuda else "cpu"
    return mine


class Ranks:
    """Rank 0 of `args.tp` ranks, the followers started and the process group joined (see the module
    docstring); `args` are `rank_zero`'s."""

    def __init__(self, args: Namespace) -> None:
        self.args, self.world = args, args.tp
        self.cuda = torch.cuda.is_available()
        self.followers: list[Any] = []

    def __enter__(self) -> RankGroup:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, self.world, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False
        )
        ctx = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, self.world):
                p = ctx.Process(
                    target=_follow, args=(rank, self.args, store.port), name=f"kvtier-rank-{rank}"
                )
                p.daemon = True
                p.start()
                self.followers.append(p)
            _join(0, self.world, store, self.cuda)
        except BaseException:
            self._stop()
            raise
        return RankGroup.from_distributed()

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        self._stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop(self) -> None:
        for p in self.followers:
            p.join(JOIN_S)
            if p.is_alive():
                log.warning("rank %s did not end within %.0f s; stopping it", p.name, JOIN_S)
                p.terminate()
                p.join(JOIN_S)
        failed = [p.name for p in self.followers if p.exitcode not in (0, None)]
        if failed:
            log.error("ranks %s ended on an error (see their log above)", ", ".join(failed))
        self.followers = []


def _join(rank: int, world: int, store: Any, cuda: bool) -> None:
    """Join the process group as `rank`, with the environment transformers reads for its mesh."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if cuda:
        torch.cuda.set_device(rank)
        # Before any pool is pinned: its pages are first touched on the GPU's own NUMA node.
        bind_to_node(torch.device("cuda", rank))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)


def _follow(rank: int, args: Namespace, port: int) -> None:
    """A follower's process: join, load the shard, build the engine rank 0 builds, follow it."""
    import sys

    import torch.distributed as dist

    from kvtier.cli.build import cache_config, engine_for, storage_config

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        store = dist.TCPStore("127.0.0.1", port, args.tp, is_master=False, timeout=START_TIMEOUT)
        cuda = torch.cuda.is_available()
        _join(rank, args.tp, store, cuda)
        mine = copy.copy(args)
        mine.device = f"cuda:{rank}" if cuda else "cpu"
        ranks = RankGroup.from_distributed()
        _, engine = engine_for(
            mine,
            "",
            cache_config(args),
            host_layout=args.host_layout,
            storage=storage_config(args),
            ranks=ranks,
        )
        engine.follow()
    except BaseException:
        log.exception("rank %d of kvtier serve failed", rank)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
