"""How a request picks its tokens: `SamplingParams`, one row's next token, its logprobs, stop strings.

Randomness: every sampled request has its own generator (`SamplingParams.generator`),
seeded from `seed` when given (the same request then draws the same tokens whatever
runs beside it), else from the operating system's entropy (each request draws afresh).

Penalties follow OpenAI's definition over the tokens generated so far (the prompt not
counted): `logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t]`,
applied before temperature and `top_p`, and before the argmax of a greedy request.

A step samples all its requests at once on the device (`sample_rows`): greedy rows take the
argmax, sampled rows race exponential noise (`argmax(p / e)`, `e ~ Exp(1)` from the row's own
generator: a draw from `p` exactly), so no row is read back on its own; `pick` is the same
rule for one row, where a step samples a request alone.

Logprobs (`TokenLogprob`) are the log-softmax of the raw logits: before penalties and
temperature (vLLM's default), so they say what the model thought, not how it was sampled.

Stop strings: generation ends at the first token whose text completes one; the answer is
cut just before the first stop string (`stop_index`). A stream holds back only the text
that could still begin one (`held_back`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine.hostio import to_device
from kvtier.errors import ConfigError

# The most alternatives a token's logprobs may list (OpenAI's limit for `top_logprobs`).
MAX_LOGPROBS = 20
# Tokens decoded to look for a stop string: a token is at least one byte of text (byte-level
# and byte-fallback tokenizers) and a character at most four, plus a few for the decode's
# context at the window's start.
STOP_WINDOW_MIN = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when `temperature` is 0 (or under `GREEDY_BELOW`).

    `timeout_s`: from `submit`; a request past it ends with finish_reason "timeout".
    `ignore_eos`: generate `max_tokens` whatever the model says (benchmarks).
    `presence_penalty` / `frequency_penalty`: in [-2, 2] (see the module docstring).
    `logprobs`: record each chosen token's logprob and this many top alternatives
    (0 to `MAX_LOGPROBS`); None records nothing.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ConfigError(
                f"presence_penalty and frequency_penalty must be in [-2, 2], got {self.presence_penalty}, "
                f"{self.frequency_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ConfigError(f"stop strings must not be empty, got {self.stop!r}")

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed by a penalty before a token is picked."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def stop_window(self) -> int:
        """Tokens whose text is enough to find the longest stop string (see `STOP_WINDOW_MIN`)."""
        return max(STOP_WINDOW_MIN, 4 * max(map(len, self.stop), default=0) + 4)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random source (from `seed`, else fresh entropy), or None for greedy."""
        if self.temperature == 0:
            return None
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()  # a non-deterministic seed: two requests never share a draw
        return gen


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's logprob and the `k` likeliest tokens' (`top`, likeliest first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# Temperatures below this sample greedily: dividing logits by less overflows float32.
GREEDY_BELOW = 1e-5


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    generated: Sequence[Sequence[int]],
) -> torch.Tensor:
    """`[R]` int64 on `logits`' device: each row's next token by `params[r]` (penalties over
    `generated[r]`, then the argmax, or a draw at its temperature within its `top_p` from
    `generators[r]`), with nothing read back from the device. `logits`: `[R, V]`."""
    dev, vocab = logits.device, logits.shape[-1]
    rows = logits.float()
    pen = [i for i, p in enumerate(params) if p.penalized and generated[i]]
    if pen:
        penalty = torch.stack([_penalty(params[i], generated[i], vocab, dev) for i in pen])
        rows = rows.index_add(0, to_device(np.array(pen), dev), penalty, alpha=-1)
    tokens = rows.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if not hot:
        return tokens
    at = to_device(np.array(hot), dev)
    temps = to_device(np.array([params[i].temperature for i in hot], np.float32), dev)
    probs = torch.softmax(rows.index_select(0, at) / temps.unsqueeze(1), dim=-1)
    top_p = np.array([params[i].top_p for i in hot], np.float32)
    if (top_p < 1).any():
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < to_device(top_p, dev).unsqueeze(1)
        keep[:, 0] = True  # the likeliest token stays, however small `top_p`
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p * keep)
    noise = torch.stack([torch.empty(vocab, device=dev).exponential_(generator=generators[i]) for i in hot])
    return tokens.index_copy(0, at, (probs / noise).argmax(dim=-1))


def _penalty(params: SamplingParams, generated: Sequence[int], vocab: int, dev: torch.device) -> torch.Tensor:
    """`[V]` float32: the presence and frequency penalties over the `generated` tokens."""
    counts = torch.bincount(to_device(np.asarray(generated, np.int64), dev), minlength=vocab).to(
        torch.float32
    )
    return params.presence_penalty * (counts > 0) + params.frequency_penalty * counts


def pick(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None, generated: Sequence[int]
) -> int:
    """The next token from one row of logits (`[V]`) after the penalties over `generated`:
    argmax, or a draw at `temperature` within `top_p`."""
    logits = penalized(logits, params, generated)
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    return int(sample_rows(logits.unsqueeze(0), [params], [gen], [()])[0])


def penalized(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """`[V]` float32 logits less the presence and frequency penalties over the `generated` tokens."""
    if not params.penalized or not generated:
        return logits
    return logits.float() - _penalty(params, generated, logits.shape[-1], logits.device)


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token`'s logprob under one row of raw logits (`[V]`) and the `k` likeliest tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token])
    if k == 0:
        return TokenLogprob(token, chosen)
    values, ids = torch.topk(logp, min(k, logp.shape[-1]))
    return TokenLogprob(token, chosen, tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def stop_index(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins, or None if none is in it."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many characters at the end of `text` could still be the start of a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
