"""`kvtier bench transfer` (one GPU, or `--gpus N`) and `kvtier bench overlap`: their flags made into a
`kvtier.bench.transfer.BenchConfig`, the runs, the tables and the JSON reports."""

from __future__ import annotations

import json
from argparse import Namespace
from dataclasses import asdict

from kvtier.bench import overlap, transfer, transfer_gpus
from kvtier.bench.common import collect
from kvtier.bench.transfer import BenchConfig, Row
from kvtier.bench.transfer_meta import metadata
from kvtier.bench.transfer_report import cells, render
from kvtier.bench.transfer_sets import DEFAULT_VARIANTS
from kvtier.cli.build import device as resolve_device
from kvtier.cli.console import console, progress, write_json
from kvtier.errors import ConfigError
from kvtier.pool import HostLayout
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import KernelOptions


def config_from_args(args: Namespace, **extra) -> BenchConfig:
    """The run `kvtier bench transfer` or `overlap` asks for; `ConfigError` before anything is built."""
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    full = preset(args.spec or "deepseek-v3", args.page_size)
    layers = extra.get("layers", 1)
    if not 1 <= layers <= full.num_layers:
        raise ConfigError(f"--layers {layers} must be in [1, {full.num_layers}], the layers of {full.name}")
    tokens = args.tokens or (131072 if cuda else 16384)
    if tokens % full.page_size:
        raise ConfigError(f"--tokens {tokens} must be a multiple of --page-size {full.page_size}")
    return BenchConfig(
        spec=full.with_layers(layers),
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


def command_config(args: Namespace) -> BenchConfig:
    """The run `kvtier bench transfer`'s flags ask for; `ConfigError` before anything is built."""
    directions = (
        (Direction.LOAD, Direction.BACKUP) if args.direction == "both" else (Direction(args.direction),)
    )
    return config_from_args(
        args,
        directions=directions,
        host_sets=args.host_sets,
        device_sets=args.device_sets,
        variants=args.variants,
        kernel_sweep=args.kernel_sweep,
        host_slots=args.host_slots,
    )


def bench_transfer(args: Namespace) -> int:
    """`kvtier bench transfer`: 0 when every timed variant passed its byte check, else 1.

    Each `--tokens` value is one run in this process, one after the other (the pools of one are freed
    before the next). With `--gpus N` other than 1, `bench_transfer_gpus` runs instead.
    """
    if args.gpus != 1:
        return bench_transfer_gpus(args)
    sizes = args.tokens or (None,)
    rows: list[Row] = []
    metas = []
    for tokens in sizes:
        cfg = command_config(Namespace(**{**vars(args), "tokens": tokens}))
        with progress() as report:
            found, meta = transfer.run(cfg, progress=report)
        rows += found
        metas.append(meta)
        collect()
    console.print(render(rows, metas))
    write_json(
        args.json,
        {
            "meta": metas[0],
            "sizes": metas,
            "rows": transfer.rows_as_dicts(rows),
            "cells": cells(rows),
        },
    )
    return 0 if all(r.identical for r in rows) else 1


def bench_transfer_gpus(args: Namespace) -> int:
    """`kvtier bench transfer --gpus N`: 0 when every rank passed every byte check, else 1."""
    if args.kernel_sweep:
        raise ConfigError(
            f"--kernel-sweep times one GPU's kernel shapes; it does not apply with --gpus {args.gpus}"
        )
    if tuple(args.variants) not in (("planned",), DEFAULT_VARIANTS):
        given = ",".join(args.variants)
        raise ConfigError(
            f"--gpus {args.gpus} times the planned path alone; --variants {given} needs one GPU"
        )
    if args.tokens and len(args.tokens) > 1:
        raise ConfigError(f"--gpus {args.gpus} times one --tokens value, not {len(args.tokens)}")
    devices = transfer_gpus.devices_for(args.gpus, args.device)
    cfg = command_config(Namespace(**{**vars(args), "tokens": args.tokens[0] if args.tokens else None}))
    with progress() as report:
        report(f"{len(devices)} ranks, one process per GPU: pinning, checking, timing")
        rows, meta = transfer_gpus.run(cfg, devices)
    console.print(transfer_gpus.render(rows, meta))
    write_json(args.json, transfer_gpus.as_json(rows, meta))
    return 0 if all(r.identical for r in rows) else 1


def bench_overlap(args: Namespace) -> int:
    """`kvtier bench overlap` (CUDA only); `--rounds-log` gets each interference round as a JSON line."""
    cfg = config_from_args(args, host_sets=("contiguous",), device_sets=("contiguous",))
    if cfg.device.type != "cuda":
        raise ConfigError(f"kvtier bench overlap needs a CUDA device, got --device {args.device}")
    log = args.rounds_log.open("w") if args.rounds_log else None

    def on_round(r: dict) -> None:
        log.write(json.dumps(r) + "\n")
        log.flush()

    try:
        with progress() as report:
            rows, s = overlap.run(cfg, report, rounds=args.rounds, on_round=on_round if log else None)
    finally:
        if log is not None:
            log.close()
    meta = metadata(cfg, s.ceilings, s.layer_bytes)
    console.print(overlap.render(rows, meta))
    write_json(args.json, {"meta": meta, "rows": [asdict(r) for r in rows]})
    return 0
