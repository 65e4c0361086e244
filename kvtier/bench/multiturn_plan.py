"""What `kvtier bench multiturn` runs: conversations of turns, and when each turn arrives.

A `Plan` is a tuple of conversations, each a tuple of `Turn`s. A turn appends `new_tokens`
random tokens to its conversation (the first turn: its whole prompt; a later one: after
the previous prompt and the answer the engine gave) and asks for exactly `output_tokens`
tokens (`ignore_eos`). The tokens come from the plan's seed alone, so every configuration
and every repeat runs the same conversations.

Arrivals, one rule per plan (`Plan.arrivals()`), each a small object the driver asks which
ready conversations to send now (`due`) and when to look again if none (`wake_at`); a
conversation is ready once its previous turn finished (a turn never goes before that):

- `ClosedLoop`: every ready conversation goes at once;
- `PoissonArrivals` (`request_rate` R): turns go at the instants of a Poisson process of
  rate R (seeded apart from the tokens), each to the conversation ready the longest; an
  instant at which none is ready waits for the first that is;
- `ScheduledArrivals` (a replayed trace, `kvtier.bench.multiturn_trace`): each turn at its
  own `arrival_s`, or when its conversation is ready if that is later.

`Workload` is the synthetic plan: `clients` conversations of `rounds` turns, `context_tokens`
before the first question, questions of `question_tokens`, answers of `output_tokens`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtier.engine import SamplingParams
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class Turn:
    """One turn: the tokens it appends, its answer's length, and (a trace) its arrival from the start."""

    new_tokens: int
    output_tokens: int
    arrival_s: float | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_tokens, temperature=0.0, ignore_eos=True)


class Waiting(Protocol):
    """What an arrival rule reads of a ready conversation: when it became ready, and its next turn's
    arrival (a trace; else None), seconds from the run's start."""

    @property
    def ready_s(self) -> float: ...

    @property
    def next_arrival_s(self) -> float | None: ...


class ClosedLoop:
    """Every ready conversation sends its next turn at once.

    `due` (every rule): the indices in `ready` of the conversations to send now, each with the
    instant its turn was due (seconds from the start; the request's latencies count from it, or
    from when its conversation became ready if that is later)."""

    def due(self, ready: Sequence[Waiting], now: float) -> list[tuple[int, float]]:
        return [(i, c.ready_s) for i, c in enumerate(ready)]

    def wake_at(self, ready: Sequence[Waiting]) -> float | None:
        return None


class PoissonArrivals:
    """Turns at the instants `ticks` (seconds, increasing), each to the conversation ready longest
    (`ready` is in the order they became ready)."""

    def __init__(self, ticks: np.ndarray) -> None:
        self.ticks, self.sent = ticks, 0

    def due(self, ready: Sequence[Waiting], now: float) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = []
        while len(out) < len(ready) and self.sent < len(self.ticks) and self.ticks[self.sent] <= now:
            out.append((len(out), float(self.ticks[self.sent])))
            self.sent += 1
        return out

    def wake_at(self, ready: Sequence[Waiting]) -> float | None:
        return float(self.ticks[self.sent]) if ready and self.sent < len(self.ticks) else None


class ScheduledArrivals:
    """Each turn at its own `arrival_s` (or when its conversation is ready, if later)."""

    def due(self, ready: Sequence[Waiting], now: float) -> list[tuple[int, float]]:
        return [(i, c.next_arrival_s) for i, c in enumerate(ready) if c.next_arrival_s <= now]

    def wake_at(self, ready: Sequence[Waiting]) -> float | None:
        return min((c.next_arrival_s for c in ready), default=None)


Arrivals = ClosedLoop | PoissonArrivals | ScheduledArrivals


@dataclass(frozen=True)
class Plan:
    """The conversations of a run and how their turns arrive (see the module docstring)."""

    conversations: tuple[tuple[Turn, ...], ...]
    request_rate: float | None = None  # turns per second, Poisson; None: closed loop or scheduled
    seed: int = 0

    def __post_init__(self) -> None:
        turns = [t for conv in self.conversations for t in conv]
        if not turns or not all(self.conversations):
            raise ConfigError("a plan needs at least one conversation, and each conversation a turn")
        if min(min(t.new_tokens, t.output_tokens) for t in turns) < 1:
            raise ConfigError("every turn appends at least one token and asks for at least one")
        timed = {t.arrival_s is not None for t in turns}
        if len(timed) > 1:
            raise ConfigError("either every turn has an arrival time (a trace) or none has")
        if self.scheduled and not all(math.isfinite(t.arrival_s) and t.arrival_s >= 0 for t in turns):
            raise ConfigError("arrival times must be finite and >= 0")
        if self.request_rate is not None and (self.scheduled or not 0 < self.request_rate < math.inf):
            raise ConfigError(
                f"request_rate must be a positive number, and a trace has its own times; got "
                f"{self.request_rate}"
            )

    @property
    def scheduled(self) -> bool:
        return self.conversations[0][0].arrival_s is not None

    @property
    def total_turns(self) -> int:
        return sum(len(c) for c in self.conversations)

    def final_tokens(self, conversation: int) -> int:
        """A conversation's length after its last answer: its last request's prompt plus output."""
        return sum(t.new_tokens + t.output_tokens for t in self.conversations[conversation])

    @property
    def longest_tokens(self) -> int:
        return max(self.final_tokens(c) for c in range(len(self.conversations)))

    @property
    def working_set_tokens(self) -> int:
        return sum(self.final_tokens(c) for c in range(len(self.conversations)))

    def tokens(self, vocab: int) -> list[list[list[int]]]:
        """`[conversation][turn]` the token ids each turn appends, from the seed alone."""
        rng = np.random.default_rng(self.seed)
        return [[rng.integers(0, vocab, t.new_tokens).tolist() for t in conv] for conv in self.conversations]

    def arrivals(self) -> Arrivals:
        """A fresh arrival rule for one run."""
        if self.scheduled:
            return ScheduledArrivals()
        if self.request_rate is None:
            return ClosedLoop()
        rng = np.random.default_rng(self.seed + 1)  # apart from the tokens: a rate changes no conversation
        return PoissonArrivals(np.cumsum(rng.exponential(1 / self.request_rate, self.total_turns)))


@dataclass(frozen=True)
class Workload:
    """The synthetic conversations (see the module docstring); `plan()` makes them."""

    clients: int
    rounds: int
    context_tokens: int = 0
    question_tokens: int = 128
    output_tokens: int = 16
    request_rate: float | None = None  # rounds per second; None: closed loop
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.clients, self.rounds, self.question_tokens, self.output_tokens) < 1:
            raise ConfigError(
                f"clients ({self.clients}), rounds ({self.rounds}), question_tokens ({self.question_tokens}) "
                f"and output_tokens ({self.output_tokens}) must be at least 1"
            )
        if self.context_tokens < 0 or (self.request_rate is not None and not self.request_rate > 0):
            raise ConfigError(
                f"context_tokens must be >= 0 and request_rate positive, got {self.context_tokens}, "
                f"{self.request_rate}"
            )

    def plan(self) -> Plan:
        first = Turn(self.context_tokens + self.question_tokens, self.output_tokens)
        later = Turn(self.question_tokens, self.output_tokens)
        conv = (first,) + (later,) * (self.rounds - 1)
        return Plan((conv,) * self.clients, self.request_rate, self.seed)
