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
    """What the routes admit: queued requests, body size and time, and each request's time.

    `max_queue`: requests waiting (in the engine's queue, the worker's, or being read, parsed
    and tokenised) before new ones are answered 429; `max_body_bytes`: larger bodies are
    answered 413; `body_timeout_s`: a body that has not wholly arrived this long after its
    headers is answered 408 and its admission slot freed (a client that stalls mid-upload
    cannot hold the queue); `request_timeout_s`: each request's `SamplingParams.timeout_s`.
    """

    max_queue: int = 256
    max_body_bytes: int = 16 << 20
    request_timeout_s: float = 600.0
    body_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if (
            self.max_queue < 1
            or self.max_body_bytes < 1
            or not (self.request_timeout_s > 0 and self.body_timeout_s > 0)
        ):
            raise ConfigError(
                f"max_queue, max_body_bytes, request_timeout_s and body_timeout_s must be positive, got "
                f"{self.max_queue}, {self.max_body_bytes}, {self.request_timeout_s}, {self.body_timeout_s}"
            )


# How long `kvtier serve` gives the requests in flight once SIGTERM comes (`--shutdown-timeout`).
SHUTDOWN_TIMEOUT_S = 5.0
