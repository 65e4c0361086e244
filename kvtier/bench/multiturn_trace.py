"""`kvtier bench multiturn --trace FILE`: a file of timed conversation turns, read into a `Plan`.

The file is CSV (`.csv`: a header row, then one row per request) or JSON Lines (`.jsonl`:
one object per line); blank lines are skipped, other columns or keys ignored. Each request
has four fields:

| field           | meaning                                                                  |
| --------------- | ------------------------------------------------------------------------ |
| `arrival_s`     | when the request arrives, seconds (any origin: the earliest becomes 0)    |
| `conversation`  | which conversation it belongs to (any text)                               |
| `input_tokens`  | its whole prompt, the conversation so far included                       |
| `output_tokens` | the answer's length (the engine is asked for exactly that many tokens)   |

For example (CSV)::

    arrival_s,conversation,input_tokens,output_tokens
    0.0,a,300,32
    0.4,b,250,1
    2.5,a,400,32

A conversation's requests are its rows in arrival order (ties in file order). Its first
request's prompt is `input_tokens` random tokens; each later one is the previous prompt,
the answer the engine gave and `input_tokens - (previous input + previous output)` new
random tokens, so a later row's input must exceed the conversation's length so far (a
request log that records whole prompts, as public serving traces do, has that shape).
Every row is checked before anything runs: a bad one raises `ConfigError` naming the
file, the line and the value.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from kvtier.bench.multiturn_plan import Plan, Turn
from kvtier.errors import ConfigError

FIELDS = ("arrival_s", "conversation", "input_tokens", "output_tokens")
Row = tuple[int, float, str, int, int]  # line, arrival_s, conversation, input_tokens, output_tokens


def read_trace(path: Path, seed: int = 0) -> Plan:
    """The plan of the trace at `path` (see the module docstring); `ConfigError` on any bad row."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the trace {path}: {e.strerror or e}") from None
    if path.suffix == ".csv":
        raw = _csv_rows(path, text)
    elif path.suffix == ".jsonl":
        raw = _jsonl_rows(path, text)
    else:
        raise ConfigError(f"trace {path}: expected a .csv or a .jsonl file")
    rows = [_row(path, line, fields) for line, fields in raw]
    if not rows:
        raise ConfigError(f"trace {path} has no requests")
    return plan_of(path, rows, seed)


def plan_of(path: Path, rows: list[Row], seed: int) -> Plan:
    """Rows grouped into conversations (ordered by their first arrival), times from the earliest."""
    start = min(r[1] for r in rows)
    by: dict[str, list[Row]] = {}
    for r in sorted(rows, key=lambda r: (r[1], r[0])):
        by.setdefault(r[2], []).append(r)
    conversations = []
    for rs in by.values():
        turns, length = [], 0
        for line, at, conv, inputs, outputs in rs:
            if inputs <= length:
                raise ConfigError(
                    f"{path}:{line}: conversation {conv!r} is {length} tokens long by then (the previous "
                    f"prompt and answer); its input_tokens {inputs} must be more"
                )
            turns.append(Turn(inputs - length, outputs, round(at - start, 6)))
            length = inputs + outputs
        conversations.append(tuple(turns))
    return Plan(tuple(conversations), seed=seed)


def _csv_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    reader = csv.DictReader(text.splitlines())
    missing = [f for f in FIELDS if f not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(f"{path}:1: the header lacks {', '.join(missing)} (has {reader.fieldnames})")
    out = []
    for row in reader:
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue
        out.append((reader.line_num, row))
    return out


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    out = []
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{line}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{line}: expected an object, got {raw.strip()[:60]!r}")
        out.append((line, obj))
    return out


def _row(path: Path, line: int, fields: dict) -> Row:
    where = f"{path}:{line}"
    missing = [f for f in FIELDS if fields.get(f) in (None, "")]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    try:
        at = float(fields["arrival_s"])
    except (TypeError, ValueError):
        at = math.nan
    if not (math.isfinite(at) and at >= 0):
        raise ConfigError(f"{where}: arrival_s must be a finite number >= 0, got {fields['arrival_s']!r}")
    conv = str(fields["conversation"]).strip()
    if not conv:
        raise ConfigError(f"{where}: conversation is empty")
    return line, at, conv, _count(where, fields, "input_tokens"), _count(where, fields, "output_tokens")


def _count(where: str, fields: dict, name: str) -> int:
    value = fields[name]
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else 0
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    return n
