"""What the `kvtier` commands print: the console, progress lines, the engine's summary, JSON reports.

`kvtier.cli.parser` parses the arguments, then calls one command of this package; these
functions and the commands are the only code that prints.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

# Wide enough for the tables when output goes to a file or a pipe.
console = Console(width=None if sys.stdout.isatty() else 140)


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
