"""What the `kvtier` commands share: the console they print to, progress, their device, JSON out.

`kvtier.cli` parses and checks the arguments, then calls one `command(args)`
function beside the command's subject (`kvtier.bench.transfer.command`,
`kvtier.engine.demo.command`, ...). Those functions and this module are the only
code that prints; library functions log through `logging`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console

from kvtier.errors import ConfigError

# Wide enough for the tables when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 140)

Report = Callable[[str], None]


def device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a device; `ConfigError` for a CUDA device this process lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: no CUDA device is available (torch {torch.__version__})")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s)")
    return dev


@contextmanager
def progress() -> Iterator[Report]:
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
