"""What the server admits, and where its API key comes from: plain values, no web framework.

`kvtier.cli` reads these for its flags' defaults, so parsing them imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError

# Where `kvtier serve` reads its API key when `--api-key` is left out.
API_KEY_ENV = "KVTIER_API_KEY"


@dataclass(frozen=True)
class Limits:
    """What the routes admit: queued requests, body size, and each request's time.

    `max_queue`: requests waiting (in the engine's queue, the worker's, or being parsed
    and tokenised) before new ones are answered 429; `max_body_bytes`: larger bodies are
    answered 413; `request_timeout_s`: each request's `SamplingParams.timeout_s`.
    """

    max_queue: int = 256
    max_body_bytes: int = 16 << 20
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_body_bytes < 1 or not self.request_timeout_s > 0:
            raise ConfigError(
                f"max_queue, max_body_bytes and request_timeout_s must be positive, got {self.max_queue}, "
                f"{self.max_body_bytes}, {self.request_timeout_s}"
            )
