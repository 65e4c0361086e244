"""`kvtier bench batching`: what continuous batching buys, in two parts over one engine.

`concurrent`: `requests` distinct random prompts of `prompt_tokens`, each asking for
`output_tokens` (`ignore_eos`), all submitted at once and stepped to the end, against as
many other such prompts run one by one (submit, step to the end, next); `ratio` is the
concurrent run's wall time over the one-by-one total (below 0.5: the batch finished in
under half the time). The two sets of prompts differ, so neither run reads the other's
cached prefixes.

`decode`: for each count `n`, `n` requests of `decode_prompt_tokens` random tokens are
submitted and stepped until every one has its first token (all decoding), then
`WARM_STEPS` untimed steps, then `steps` timed steps: generated tokens per second and
milliseconds per step. Each request asks for more tokens than the prefill of all `n` and the
steps after it can make, so all `n` decode in every timed step (a timed step that decodes fewer
is refused: the row would be a smaller batch's). The requests are cancelled before the next count.

One short request runs first, untimed, so no row pays for the first forward's setup.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rich.console import Group
from rich.table import Table

from kvtier.bench.common import close, quiet
from kvtier.bench.engines import drain, run_alone, step, vocab_size
from kvtier.engine import Engine, SamplingParams
from kvtier.errors import ConfigError, InvariantError

PARTS = ("concurrent", "decode")
WARM_STEPS = 2


@dataclass(frozen=True)
class BatchingBench:
    """The sizes of both parts (see the module docstring)."""

    requests: int = 6
    prompt_tokens: int = 128
    output_tokens: int = 64
    running: tuple[int, ...] = (1, 8, 32, 64)
    decode_prompt_tokens: int = 32
    steps: int = 16
    seed: int = 0
    parts: tuple[str, ...] = PARTS
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        sizes = (
            self.requests,
            self.prompt_tokens,
            self.output_tokens,
            self.decode_prompt_tokens,
            self.steps,
            self.max_num_batched_tokens,
        )
        if min(*sizes, *self.running, 1) < 1 or not self.running:
            raise ConfigError(f"every size must be at least 1, got {self}")
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise ConfigError(f"unknown part(s) {bad or self.parts}; known: {', '.join(PARTS)}")

    def device_tokens(self) -> int:
        """Device slots both parts need at most at once, with a request's worth of margin."""
        batch = self.requests * (self.prompt_tokens + self.output_tokens)
        n = max(self.running)
        decode = n * (self.decode_prompt_tokens + self.decode_tokens(n))
        return max(batch, decode) + self.prompt_tokens + self.output_tokens

    def decode_tokens(self, n: int) -> int:
        """Tokens each of `n` decode requests asks for: more than it can make before it is cancelled.

        The first prompts decode while the others still prefill: at most one step per
        `max_num_batched_tokens - n` prompt tokens (the decodes take the rest of a step's
        budget), plus one per request where its prompt is cut into pieces."""
        spare = max(self.max_num_batched_tokens - n, 1)
        prefill_steps = -(-n * self.decode_prompt_tokens // spare) + n
        return prefill_steps + WARM_STEPS + self.steps + 1

    def max_num_seqs(self) -> int:
        return max(self.requests, *self.running)


@dataclass
class DecodeRow:
    running: int
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    ms_per_step: float


def concurrent(eng: Engine, bench: BatchingBench, rng: np.random.Generator, vocab: int) -> dict:
    """The batch of `requests` at once against as many run one by one; wall times and their ratio."""
    params = SamplingParams(max_tokens=bench.output_tokens, temperature=0.0, ignore_eos=True)
    prompts = rng.integers(0, vocab, (2, bench.requests, bench.prompt_tokens)).tolist()
    t0 = time.perf_counter()
    reqs = [eng.submit(p, params) for p in prompts[0]]
    finished: dict[int, float] = {}
    while eng.busy:
        for update in step(eng):
            if update.result is not None:
                finished[update.request.id] = time.perf_counter() - t0
    together = time.perf_counter() - t0
    one_by_one = []  # seconds from the first submit to each request's end
    t0 = time.perf_counter()
    for p in prompts[1]:
        run_alone(eng, p, params)
        one_by_one.append(time.perf_counter() - t0)
    sequential = one_by_one[-1]
    return {
        "requests": bench.requests,
        "prompt_tokens": bench.prompt_tokens,
        "output_tokens": bench.output_tokens,
        "concurrent_s": round(together, 4),
        "sequential_s": round(sequential, 4),
        "ratio": round(together / sequential, 4),
        "concurrent_finish_s": [round(finished[r.id], 4) for r in reqs],
        "sequential_finish_s": [round(t, 4) for t in one_by_one],
        "alone_s": [round(float(t), 4) for t in np.diff([0.0, *one_by_one])],
    }


def decode_rate(eng: Engine, n: int, bench: BatchingBench, rng: np.random.Generator, vocab: int) -> DecodeRow:
    """`n` requests decoding at once: the rate of `bench.steps` steps once all of them decode."""
    params = SamplingParams(max_tokens=bench.decode_tokens(n), temperature=0.0, ignore_eos=True)
    reqs = [eng.submit(p, params) for p in rng.integers(0, vocab, (n, bench.decode_prompt_tokens)).tolist()]
    try:
        while eng.num_waiting or any(not r.tokens for r in reqs):
            if not eng.busy:
                raise InvariantError(f"{n} decode requests finished before all of them decoded")
            step(eng)
        for _ in range(WARM_STEPS):
            step(eng)
        if eng.num_running != n:
            raise InvariantError(f"{eng.num_running} requests running, expected {n}: raise --device-tokens")
        tokens = 0
        t0 = time.perf_counter()
        for i in range(bench.steps):
            made = sum(u.token is not None for u in step(eng))
            if made != n:
                raise InvariantError(f"timed decode step {i} made {made} tokens with {n} requests running")
            tokens += made
        seconds = time.perf_counter() - t0
    finally:
        for r in reqs:
            eng.cancel(r)
        drain(eng)
    return DecodeRow(
        running=n,
        steps=bench.steps,
        tokens=tokens,
        seconds=round(seconds, 5),
        tokens_per_s=round(tokens / seconds, 2),
        ms_per_step=round(seconds / bench.steps * 1e3, 3),
    )


def run(
    model,
    tokenizer,
    bench: BatchingBench,
    device_tokens: int | None = None,
    progress: Callable[[str], None] = quiet,
    enforce_eager: bool = False,
) -> tuple[dict | None, list[DecodeRow], dict]:
    """Both parts on one engine: `(concurrent summary or None, decode rows, engine summary)`.

    `enforce_eager`: the engine's (no CUDA graphs for decode steps)."""
    vocab = vocab_size(model)
    rng = np.random.default_rng(bench.seed)
    tokens = device_tokens or bench.device_tokens()
    eng = Engine(
        model,
        tokenizer,
        device_tokens=tokens,
        host_tokens=tokens,
        max_num_seqs=bench.max_num_seqs(),
        max_num_batched_tokens=bench.max_num_batched_tokens,
        enforce_eager=enforce_eager,
    )
    try:
        run_alone(eng, rng.integers(0, vocab, 16).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
        together = None
        if "concurrent" in bench.parts:
            progress(f"{bench.requests} requests at once, then one by one")
            together = concurrent(eng, bench, rng, vocab)
        rows = []
        for n in bench.running if "decode" in bench.parts else ():
            progress(f"decode with {n} running")
            rows.append(decode_rate(eng, n, bench, rng, vocab))
        summary = {**eng.summary(), "enforce_eager": enforce_eager}
    finally:
        close(eng)
    return together, rows, summary


def render(together: dict | None, rows: list[DecodeRow], meta: dict) -> Group:
    """The one-by-one comparison (its ratio) and the decode table."""
    parts: list = [f"{meta['model']}, {meta['dtype']}, on {meta.get('gpu', meta['device'])}"]
    if together is not None:
        parts.append(
            f"{together['requests']} requests of {together['prompt_tokens']} + {together['output_tokens']} "
            f"tokens: at once {together['concurrent_s']:.3f} s, one by one {together['sequential_s']:.3f} s, "
            f"ratio {together['ratio']:.3f}"
        )
    if rows:
        table = Table(
            title=f"Decode throughput ({rows[0].steps} steps, prompts of {meta['decode_prompt_tokens']})"
        )
        for col in ("running", "tokens/s", "ms/step"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(str(r.running), f"{r.tokens_per_s:.1f}", f"{r.ms_per_step:.2f}")
        parts.append(table)
    return Group(*parts)
