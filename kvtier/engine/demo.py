"""`kvtier demo`: multi-turn chats on a real model with a device KV budget that forces reloads.

Several conversations share a long system prompt and take turns, so by the time a
conversation comes back its earlier turns have been evicted from the device to the
host and are reloaded. Every answer is checked, token for token, against plain
`model.generate` on the same prompt without any cache reuse.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.table import Table

from kvtier.engine.engine import Engine, RequestResult, SamplingParams

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
    result: RequestResult
    reference: list[int]

    @property
    def identical(self) -> bool:
        return self.result.tokens == self.reference


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
            turn = Turn(i, t, result, reference)
            turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
            histories[i].append({"role": "assistant", "content": result.text})
    return turns


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
    """`kvtier demo`: 0 when every answer equals plain generation, else 1."""
    from rich.progress import Progress

    from kvtier.cache import CacheConfig, WritePolicy
    from kvtier.commands import console, engine_for

    config = CacheConfig(write_policy=WritePolicy(args.write_policy))
    loading = "loading the model (the first run converts it once, about a minute)"
    dev, engine = engine_for(args, loading, config)
    console.print(
        f"{engine.spec.name}: {engine.spec.num_layers} layers, "
        f"{engine.spec.bytes_per_token() // 1024} KiB of KV per token; "
        f"device budget {args.device_tokens} tokens, host {args.host_tokens}, on {dev}"
    )
    table = Table(title="turns")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("hit", "same as plain") else "right")
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("turns", total=sum(len(c) for c in CONVERSATIONS))

        def on_turn(t: Turn) -> None:
            console.print(_turn_line(t), highlight=False)
            table.add_row(*_turn_cells(t))
            bar.advance(task)

        turns = run_demo(engine, args.max_tokens, on_turn=on_turn)
    console.print(table)
    m = engine.cache.metrics
    console.print(
        f"prompt tokens: {m.device_hit_tokens} from the device, {m.host_hit_tokens} from the host, "
        f"{m.miss_tokens} computed; {m.device_evictions} device evictions; "
        f"{m.bytes_h2d / 1e6:.1f} MB reloaded, {m.bytes_d2h / 1e6:.1f} MB backed up"
    )
    engine.cache.flush()
    engine.cache.check_invariants()
    engine.close()
    same = sum(t.identical for t in turns)
    console.print(f"answers identical to plain generation without cache reuse: {same} of {len(turns)}")
    return 0 if same == len(turns) else 1


COLUMNS = ("conv", "turn", "prompt", "hit", "device", "host", "reloaded", "reload", "TTFT", "same as plain")


def _speed(r: RequestResult) -> str:
    """The reload's rate and time where it can be told apart from the forward, else `overlapped`."""
    if r.loaded_tokens and r.reload_s:
        return f"{r.loaded_bytes / 1e6 / r.reload_s:.0f} MB/s, {r.reload_s * 1e3:.1f} ms"
    return "overlapped" if r.loaded_tokens else ""


def _turn_line(t: Turn) -> str:
    r = t.result
    return (
        f"conv {t.conversation} turn {t.turn}: {r.prompt_tokens} prompt tokens, hit {r.hit} "
        f"(device {r.device_hit_tokens}, host {r.host_hit_tokens}), reloaded {r.loaded_tokens} tokens "
        f"({r.loaded_bytes / 1e6:.1f} MB) {_speed(r)}, TTFT {r.ttft_s * 1e3:.0f} ms: {r.text!r}"
    )


def _turn_cells(t: Turn) -> tuple[str, ...]:
    r = t.result
    counts = (t.conversation, t.turn, r.prompt_tokens, r.hit, r.device_hit_tokens, r.host_hit_tokens)
    same = "yes" if t.identical else "[red]NO[/red]"
    return (*map(str, counts), f"{r.loaded_bytes / 1e6:.1f} MB", _speed(r), f"{r.ttft_s * 1e3:.0f} ms", same)
