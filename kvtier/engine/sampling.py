"""How a request picks its tokens: `SamplingParams`, and picking one row's next token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when `temperature == 0`.

    `timeout_s`: from `submit`; a request past it ends with finish_reason "timeout".
    `ignore_eos`: generate `max_tokens` whatever the model says (benchmarks).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's random source (seeded when `seed` is given), or None for greedy."""
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        return gen


def pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """The next token from one row of logits (`[V]`): argmax, or a draw at `temperature` within `top_p`."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
