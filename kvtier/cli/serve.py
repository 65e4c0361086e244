"""`kvtier serve`: check the flags, bind the port, load the model, serve until SIGTERM or Ctrl-C.

The port is bound before the model loads: a port in use is refused at once. With `--tp N`,
the other ranks are started first (`kvtier.cli.tensor_parallel`). uvicorn serves the app
(`kvtier.server.app`). SIGTERM or Ctrl-C starts a bounded shutdown: uvicorn stops accepting
connections, the app answers 503 to new requests, lets what runs or waits go on for
`--shutdown-timeout` seconds and cancels what is left (each answered 503); then the app's
shutdown closes the engine (pending storage writes flushed) and the command exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
from argparse import Namespace
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import uvicorn  # a missing server package is refused before the model loads

from kvtier.cache.storage_mover import HostStorageMover
from kvtier.cli.build import HOST_TOKENS_CAP, cache_config, device, engine_for, storage_config
from kvtier.cli.console import console, summary_lines
from kvtier.cli.tensor_parallel import Ranks, rank_zero
from kvtier.engine.engine import Engine
from kvtier.engine.models import DEFAULT_MODEL
from kvtier.errors import ConfigError
from kvtier.server.app import create_app
from kvtier.server.limits import API_KEY_ENV
from kvtier.server.web import listening_socket
from kvtier.storage.backend import probe

# Seconds uvicorn waits past `--shutdown-timeout` for the connections to close before it drops them.
GRACE_S = 5


class _Server(uvicorn.Server):
    """uvicorn's server, which starts the app's bounded drain as its shutdown begins (on SIGTERM or
    Ctrl-C: uvicorn has stopped accepting connections; the app answers 503 to new requests on open
    ones and cancels what still runs at `--shutdown-timeout`)."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain = drain

    async def shutdown(self, sockets: list | None = None) -> None:
        self.drain()
        await super().shutdown(sockets)


class _Terminated(Exception):
    """SIGTERM, raised in the main thread once uvicorn has shut down and re-raised the signal."""


def _terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated


def command(args: Namespace) -> int:
    """`kvtier serve`: check the flags, bind the port, load the model, serve until SIGTERM or Ctrl-C; 0."""
    config = cache_config(args)
    storage = storage_config(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and not api_key.strip():
        raise ConfigError(f"the API key (--api-key or ${API_KEY_ENV}) is empty")
    device(args.device)  # no CUDA: refused before the port is taken
    if args.tp > 1:
        args = rank_zero(args)  # --tp against the devices and the checkpoint's heads
        if args.host_tokens is None:  # every rank builds the same pools: one size, not each rank's own
            args.host_tokens = HOST_TOKENS_CAP
    sock = listening_socket(args.host, args.port)
    followers = ExitStack()
    try:
        ranks = followers.enter_context(Ranks(args)) if args.tp > 1 else None
        dev, engine = engine_for(
            args, "loading the model", config, ranks, host_layout=args.host_layout, storage=storage
        )
    except BaseException:
        sock.close()
        followers.close()
        raise
    with followers:  # the other ranks end once the engine has closed
        return _serve(args, engine, dev, api_key, sock)


def _serve(args: Namespace, engine: Engine, dev: Any, api_key: str | None, sock: Any) -> int:
    """Serve `engine` on the bound `sock` until SIGTERM or Ctrl-C; 0."""
    name = args.model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    tier = f", storage on {engine.storage.backend.describe()}" if engine.storage is not None else ""
    app = create_app(
        engine,
        name,
        max_queue=args.max_queue,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        request_timeout_s=args.request_timeout,
        body_timeout_s=args.body_timeout,
        api_key=api_key,
        access_log=not args.no_access_log,
    )
    if not args.no_access_log:  # shown without -v: the access log is INFO on its own logger
        logging.getLogger("kvtier.access").setLevel(logging.INFO)
    for line in summary_lines(engine.summary()):
        console.print(line, highlight=False)
    if engine.storage is not None and (why := probe(engine.storage.backend)) is not None:
        console.print(
            f"warning: storage {engine.storage.backend.describe()} is unreachable ({why}); serving without "
            "it, and trying again while serving (/health and /metrics say when it answers)",
            style="yellow",
            highlight=False,
        )
    keyed = ", API key required" if api_key is not None else ""
    ranks = f", {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
    console.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({dev}{ranks}{tier}{keyed})")
    # uvicorn's own bound on the connections left once the app has cancelled what it held.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=int(args.shutdown_timeout) + GRACE_S,
    )
    server = _Server(config, lambda: app.state.drain(args.shutdown_timeout))
    # uvicorn handles SIGTERM and SIGINT itself (a graceful shutdown, the app's included),
    # then raises the signal again for the handler it found: this one, and Python's for SIGINT.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except (_Terminated, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        app.state.shutdown()  # done by the app's shutdown already, unless uvicorn never started
    console.print(f"stopped; {_stored(engine.storage)}" if engine.storage is not None else "stopped")
    return 0


def _stored(storage: HostStorageMover) -> str:
    m = storage.metrics.snapshot()
    return f"{m['pages_written']} pages ({m['bytes_written'] / 1e6:.1f} MB) written to storage"
