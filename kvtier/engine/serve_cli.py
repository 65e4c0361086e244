"""`kvtier serve`: load a model, build the engine over the tiered cache, run the OpenAI server on it."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path


def command(args: Namespace) -> int:
    """Serve until interrupted; the app itself is `kvtier.engine.server.create_app`."""
    import uvicorn

    from kvtier.alloc import AllocPolicy
    from kvtier.cache import CacheConfig, WritePolicy
    from kvtier.commands import console, device
    from kvtier.engine import Engine
    from kvtier.engine.models import DEFAULT_MODEL, load_model
    from kvtier.engine.server import create_app

    dev = device(args.device)
    with console.status("loading the model"):
        model, tokenizer = load_model(args.model, dev)
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
    console.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({dev})")
    try:
        uvicorn.run(create_app(engine, name), host=args.host, port=args.port, log_level="warning")
    finally:
        close = getattr(engine, "close", None)  # returns the pinned host pool where the engine can
        if close is not None:
            close()
    return 0
