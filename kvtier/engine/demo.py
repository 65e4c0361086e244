"""`kvtier demo`: multi-turn chats on a real model with a device KV budget that forces reloads.

Several conversations share a long system prompt and take turns, so by the time a
conversation comes back its earlier turns have been evicted from the device to the
host and are reloaded. Every answer is checked, token for token, against plain
`model.generate` on the same prompt without any cache reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    question: str
    result: RequestResult
    reference: list[int]

    @property
    def identical(self) -> bool:
        return self.result.tokens == self.reference


def run_demo(
    engine: Engine,
    max_tokens: int = 32,
    conversations: list[list[str]] | None = None,
    on_turn: Callable[[Turn], None] | None = None,
) -> list[Turn]:
    """Play the conversations round-robin; returns every turn with its reference check."""
    convs = conversations or CONVERSATIONS
    histories = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    params = SamplingParams(max_tokens=max_tokens)
    turns: list[Turn] = []
    for t in range(max(len(c) for c in convs)):
        for i, conv in enumerate(convs):
            if t >= len(conv):
                continue
            histories[i].append({"role": "user", "content": conv[t]})
            prompt = engine.encode_chat(histories[i])
            result = engine.generate(prompt, params)
            reference = _plain_generate(engine, prompt, max_tokens)
            turn = Turn(i, t, conv[t], result, reference)
            turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
            histories[i].append({"role": "assistant", "content": result.text})
    return turns


@torch.inference_mode()
def _plain_generate(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from `model.generate` with a fresh cache: no reuse of any kind."""
    ids = torch.tensor([prompt], device=engine.device)
    out = engine.model.generate(
        ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
    )
    tokens = out[0, len(prompt) :].tolist()
    eos = engine._eos()
    for k, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: k + 1]
    return tokens
