"""What the engine hands back: a finished request's `RequestResult` (made from the request by
`RequestResult.of`), a step's `Update`s, its counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvtier.engine.sampling import TokenLogprob
from kvtier.engine.scheduler import Request


@dataclass
class RequestResult:
    """What one request did: its tokens, text and where its prefix came from.

    `tokens`: every token generated; `text`: their text cut just before the first stop string.

        `storage_hit_tokens`: tokens prefetched from storage (then loaded like a host hit; not
        counted in `host_hit_tokens`).
        `load_s`: host time to submit the reload; `reload_s`: the reload's own time where
        it can be told apart from the forward (CPU), else None (on a GPU it overlaps
        the forward layer by layer).
    """

    prompt_tokens: int
    tokens: list[int]
    text: str
    ttft_s: float
    total_s: float
    device_hit_tokens: int
    host_hit_tokens: int
    loaded_tokens: int
    loaded_bytes: int
    load_s: float
    storage_hit_tokens: int = 0
    reload_s: float | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    finish_reason: str = "stop"  # "stop" (EOS or a stop string), "length", "cancelled", "timeout"
    preemptions: int = 0  # times the request was preempted and resumed
    token_times: list[float] = field(default_factory=list, repr=False)  # perf_counter of each token
    # One per token of `tokens` where `SamplingParams.logprobs` was set, else None.
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, req: Request, text: str, kv_bytes_per_token: int) -> RequestResult:
        """What `req` did so far, `text` its answer's text (once it finished, its result: `total_s`
        runs to its last token; before, to now)."""
        m = req.match
        end = req.token_times[-1] if req.finished and req.token_times else time.perf_counter()
        return cls(
            prompt_tokens=len(req.prompt),
            tokens=list(req.tokens),
            text=text,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            ttft_s=req.token_times[0] - req.t0 if req.token_times else 0.0,
            total_s=end - req.t0,
            device_hit_tokens=m.device_tokens if m is not None else 0,
            host_hit_tokens=m.host_tokens if m is not None else 0,
            loaded_tokens=req.load_tokens,
            storage_hit_tokens=m.storage_tokens_used if m is not None else 0,
            loaded_bytes=req.load_tokens * kv_bytes_per_token,
            load_s=req.load_s,
            reload_s=req.reload_s,
            first_logits=req.first_logits,
            finish_reason=req.finish_reason or "running",
            preemptions=req.preemptions,
            token_times=list(req.token_times),
        )

    @property
    def hit(self) -> str:
        if self.storage_hit_tokens:
            return "storage"
        return "host" if self.host_hit_tokens else "device" if self.device_hit_tokens else "none"


@dataclass
class EngineStats:
    """The engine's counters since it started (plain ints; the server exports them)."""

    prompt_tokens: int = 0  # prompt tokens of the requests admitted
    generation_tokens: int = 0  # tokens generated
    preemptions: int = 0  # running requests preempted under memory pressure
    finished: dict[str, int] = field(default_factory=dict)  # requests finished, by finish reason


@dataclass(frozen=True)
class Update:
    """What one step did for one request: a new token, and its result once it finished.

    `error`: the step failed for this request (it is finished; `result` is None).
    """

    request: Request
    token: int | None = None
    result: RequestResult | None = None
    error: BaseException | None = None
