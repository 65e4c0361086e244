"""`kvtier demo`: multi-turn chats on a real model with a device KV budget that forces reloads.

Several conversations share a long system prompt and take turns, so by the time a
conversation comes back its earlier turns have been evicted from the device to the
host and are reloaded. Every answer is checked, token for token, against plain
`model.generate` on the same prompt without any cache reuse.

Then the restart part (`run_restart`): the first conversation's last turn is asked of an
engine over a storage tier (`--storage`, else a temporary `file://` store), that engine is
closed (its writes flushed), and a new engine over the same store is asked again: its
prefix comes back from storage and its answer is the same tokens.
"""

from __future__ import annotations

import tempfile
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.table import Table

from kvtier.engine.engine import Engine
from kvtier.engine.models import DEFAULT_MODEL
from kvtier.engine.results import RequestResult
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError

SYSTEM = (
    "You are a concise assistant for a travel agency. Answer in one or two sentences. "
    "The agency's rules: bookings open at 9 am, refunds take five working days, pets travel "
    "in the cabin only below eight kilograms, and every customer gets a free city map. "
    "Our offices are in Lyon, Porto, Gdansk and Trieste; each one speaks the local language "
    "and English. When you are unsure, say so and suggest calling the nearest office."
)

CONVERSATIONS = [
    [
        "Which cities do you have offices in?",
        "Which of them is in Poland?",
        "What language do they speak there?",
    ],
    [
        "How long does a refund take?",
        "Can I bring my cat of five kilograms?",
        "And a dog of twenty kilograms?",
    ],
    ["When do bookings open?", "Do I get anything for free?", "Summarise our talk in one sentence."],
]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: list[int]
    result: RequestResult
    reference: list[int]

    @property
    def identical(self) -> bool:
        return self.result.tokens == self.reference


@dataclass
class Restart:
    """One turn asked of an engine over a store, then of a new engine over the same store."""

    turn: Turn  # the turn replayed, with its plain-generation reference
    before: RequestResult
    after: RequestResult
    pages_written: int  # by the first engine, all flushed by its close
    bytes_written: int

    @property
    def ok(self) -> bool:
        """The prefix came back from storage and both answers are the plain ones."""
        return self.after.hit == "storage" and self.before.tokens == self.after.tokens == self.turn.reference


def run_demo(
    engine: Engine, max_tokens: int = 32, on_turn: Callable[[Turn], None] | None = None
) -> list[Turn]:
    """Play the conversations round-robin; returns every turn with its reference check."""
    histories = [[{"role": "system", "content": SYSTEM}] for _ in CONVERSATIONS]
    params = SamplingParams(max_tokens=max_tokens)
    turns: list[Turn] = []
    for t in range(max(len(c) for c in CONVERSATIONS)):
        for i, conv in enumerate(CONVERSATIONS):
            if t >= len(conv):
                continue
            histories[i].append({"role": "user", "content": conv[t]})
            prompt = engine.encode_chat(histories[i])
            result = engine.generate(prompt, params)
            reference = _plain_generate(engine, prompt, max_tokens)
            turn = Turn(i, t, prompt, result, reference)
            turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
            histories[i].append({"role": "assistant", "content": result.text})
    return turns


def run_restart(build: Callable[[], Engine], turn: Turn, max_tokens: int = 32) -> Restart:
    """Ask `turn`'s prompt of `build()`, close it, then ask it of a second `build()` over the same store."""
    params = SamplingParams(max_tokens=max_tokens)
    with build() as first:
        if first.storage is None:
            raise ConfigError("run_restart needs engines with a storage tier: build them with storage=")
        before = first.generate(turn.prompt, params)
    written = first.storage.metrics.snapshot()  # read after the close: every write has finished
    with build() as second:
        after = second.generate(turn.prompt, params)
    return Restart(turn, before, after, written["pages_written"], written["bytes_written"])


@torch.inference_mode()
def _plain_generate(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from `model.generate` with a fresh cache: no reuse of any kind.

    `generate` stops at the model's end-of-sequence ids itself (the tokenizer's where the
    model's generation config names none) and keeps the one it stopped at, as the engine does.
    """
    ids = torch.tensor([prompt], device=engine.device)
    config = getattr(engine.model, "generation_config", None)
    stop = {}
    if getattr(config, "eos_token_id", None) is None and engine.tokenizer is not None:
        stop = {"eos_token_id": engine.tokenizer.eos_token_id}
    out = engine.model.generate(
        ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids), **stop
    )
    return out[0, len(prompt) :].tolist()


def command(args: Namespace) -> int:
    """`kvtier demo`: 0 when every answer equals plain generation and the restart hits storage, else 1."""
    from kvtier.cache import CacheConfig, WritePolicy
    from kvtier.cli.build import engine_for, engine_sizes, storage_config
    from kvtier.cli.console import console, summary_lines

    config = CacheConfig(write_policy=WritePolicy(args.write_policy))
    storage = storage_config(args) if args.storage else None
    with tempfile.TemporaryDirectory(prefix="kvtier-storage-demo-") as scratch:
        restart_storage = storage or storage_config(args, f"file://{scratch}")  # checked before loading
        loading = "loading the model"
        dev, engine = engine_for(args, loading, config, storage=storage)
        if engine.chat_template is None:
            engine.close()
            raise ConfigError(
                f"the tokenizer of {args.model or DEFAULT_MODEL} has no chat template, which the demo's "
                "conversations need: give one with --chat-template FILE"
            )
        for line in summary_lines(engine.summary()):
            console.print(line, highlight=False)
        tier = f"; storage {engine.storage.backend.describe()}" if engine.storage is not None else ""
        console.print(f"{engine.spec.num_layers} layers on {dev}{tier}", highlight=False)
        turns = _play(engine, args.max_tokens)
        same = sum(t.identical for t in turns)
        console.print(f"answers identical to plain generation without cache reuse: {same} of {len(turns)}")
        model, tokenizer = engine.model, engine.tokenizer

        def build() -> Engine:
            return Engine(model, tokenizer, config=config, storage=restart_storage, **engine_sizes(args))

        console.print(
            f"restart: the first conversation's last turn on an engine over {restart_storage.url}, "
            "then on a new engine over the same store"
        )
        restart = run_restart(build, [t for t in turns if t.conversation == 0][-1], args.max_tokens)
    _print_restart(restart)
    return 0 if same == len(turns) and restart.ok else 1


def _play(engine: Engine, max_tokens: int) -> list[Turn]:
    """The conversations on `engine`, a line and a table row per turn, then the cache's totals; closes it."""
    from rich.progress import Progress

    from kvtier.cli.console import console

    table = Table(title="turns")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("hit", "same as plain") else "right")
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("turns", total=sum(len(c) for c in CONVERSATIONS))

        def on_turn(t: Turn) -> None:
            console.print(_turn_line(t), highlight=False)
            table.add_row(*_turn_cells(t))
            bar.advance(task)

        turns = run_demo(engine, max_tokens, on_turn=on_turn)
    console.print(table)
    m = engine.cache.metrics
    stored = f", {m.storage_hit_tokens} from storage" if engine.storage is not None else ""
    console.print(
        f"prompt tokens: {m.device_hit_tokens} from the device, {m.host_hit_tokens} from the host"
        f"{stored}, {m.miss_tokens} computed; {m.device_evictions} device evictions; "
        f"{m.bytes_h2d / 1e6:.1f} MB reloaded, {m.bytes_d2h / 1e6:.1f} MB backed up"
    )
    engine.cache.flush()
    engine.cache.check_invariants()
    engine.close()
    return turns


def _print_restart(r: Restart) -> None:
    """The restart part's table and its verdict."""
    from kvtier.cli.console import console

    table = Table(title=f"restart: conversation {r.turn.conversation}, turn {r.turn.turn}, asked twice")
    for col in RESTART_COLUMNS:
        table.add_column(col, justify="left" if col in ("engine", "hit", "same as plain") else "right")
    for name, result in (("first", r.before), ("after restart", r.after)):
        same = "yes" if result.tokens == r.turn.reference else "[red]NO[/red]"
        counts = (result.prompt_tokens, result.hit, result.storage_hit_tokens, result.host_hit_tokens)
        table.add_row(name, *map(str, (*counts, result.device_hit_tokens)), _ms(result.ttft_s), same)
    console.print(table)
    a = r.after
    console.print(
        f"the first engine wrote {r.pages_written} pages ({r.bytes_written / 1e6:.1f} MB) and was closed; "
        f"after the restart: hit {a.hit}, {a.storage_hit_tokens} of {a.prompt_tokens} prompt tokens "
        f"from storage, TTFT {_ms(a.ttft_s)} (first engine {_ms(r.before.ttft_s)}); "
        f"tokens identical to the first engine's and to plain generation: {'yes' if r.ok else 'NO'}",
        highlight=False,
    )


COLUMNS = (
    *("conv", "turn", "prompt", "hit", "device", "host", "storage"),
    *("reloaded", "reload", "TTFT", "same as plain"),
)
RESTART_COLUMNS = ("engine", "prompt", "hit", "storage", "host", "device", "TTFT", "same as plain")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _speed(r: RequestResult) -> str:
    """The reload's rate and time where it can be told apart from the forward, else `overlapped`."""
    if r.loaded_tokens and r.reload_s:
        return f"{r.loaded_bytes / 1e6 / r.reload_s:.0f} MB/s, {r.reload_s * 1e3:.1f} ms"
    return "overlapped" if r.loaded_tokens else ""


def _turn_line(t: Turn) -> str:
    r = t.result
    return (
        f"conv {t.conversation} turn {t.turn}: {r.prompt_tokens} prompt tokens, hit {r.hit} "
        f"(device {r.device_hit_tokens}, host {r.host_hit_tokens}, storage {r.storage_hit_tokens}), "
        f"reloaded {r.loaded_tokens} tokens "
        f"({r.loaded_bytes / 1e6:.1f} MB) {_speed(r)}, TTFT {r.ttft_s * 1e3:.0f} ms: {r.text!r}"
    )


def _turn_cells(t: Turn) -> tuple[str, ...]:
    r = t.result
    counts = (t.conversation, t.turn, r.prompt_tokens, r.hit, r.device_hit_tokens, r.host_hit_tokens)
    same = "yes" if t.identical else "[red]NO[/red]"
    cells = (*counts, r.storage_hit_tokens, f"{r.loaded_bytes / 1e6:.1f} MB", _speed(r), _ms(r.ttft_s))
    return (*map(str, cells), same)
