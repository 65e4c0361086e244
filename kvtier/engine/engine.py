"""The request loop: prompt -> cache match -> load back -> prefill of the suffix -> decode -> insert.

`Engine` runs one request at a time over a transformers causal LM and a
`CacheController`. Per request it applies the chat template, matches the prompt
against the cache, locks the match, loads back what is only on the host (each
layer of the forward waits for its own layer of the load), prefills only the
uncached suffix (in chunks of `prefill_chunk` tokens), decodes (greedy or
temperature / top-p sampling, stop strings), inserts the sequence whose KV was
computed and releases its lock. A request that fails (bad input, a full cache)
leaves the cache consistent: its slots go back, its lease is released.

The structure keeps batching possible later: per-request state lives in
`KVTierCache` and `RequestResult`; the engine holds only shared objects.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController, token_ids
from kvtier.engine.hf import KVTierCache, spec_from_hf_config
from kvtier.errors import KVTierError
from kvtier.pool import DevicePool, HostPool

log = logging.getLogger(__name__)


class PromptTooLongError(KVTierError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when `temperature == 0`."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )


@dataclass
class RequestResult:
    """What one request did: its tokens, text and where its prefix came from.

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
    reload_s: float | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def hit(self) -> str:
        if self.host_hit_tokens:
            return "host"
        return "device" if self.device_hit_tokens else "none"


class Engine:
    """Serve `model` (a transformers causal LM) through kvtier's tiered cache.

    `device_tokens` / `host_tokens`: KV pool sizes of the two tiers; `prefill_chunk`:
    the longest piece of a prompt one forward pass computes.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        device_tokens: int = 8192,
        host_tokens: int = 65536,
        config: CacheConfig | None = None,
        host_layout: str = "layer_first",
        prefill_chunk: int = 8192,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.spec = spec_from_hf_config(model.config, dtype=dtype)
        self.device_pool = DevicePool(
            self.spec, device_tokens, self.device, staging_tokens=min(device_tokens, 4096)
        )
        self.host_pool = HostPool(self.spec, host_tokens, host_layout)
        self.cache = CacheController(self.device_pool, self.host_pool, config)
        text = (
            model.config.get_text_config(decoder=True)
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        self.max_context = int(getattr(text, "max_position_embeddings", 0) or 0)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -- prompts -----------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the generation prompt appended (the tokenizer's template)."""
        if self.tokenizer is None:
            raise ValueError("encode_chat needs a tokenizer")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True) if self.tokenizer else ""

    # -- requests ----------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None) -> RequestResult:
        """Run one request on prompt token ids to the end; see the module docstring."""
        stream = self.stream(prompt, params)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(
        self, prompt: Sequence[int], params: SamplingParams | None = None
    ) -> Generator[int, None, RequestResult]:
        """Run one request, yielding each new token; returns its `RequestResult`.

        Closing the generator early (a client that went away) stops decoding; the
        tokens whose KV was computed are inserted, every other slot is freed and the
        lease released, so the cache stays consistent.
        """
        params = params or SamplingParams()
        ids = token_ids(prompt)  # the cache matches and inserts arrays; decoding uses the list
        prompt = ids.tolist()
        if not prompt:
            raise ValueError("empty prompt")
        if self.max_context and len(prompt) + params.max_tokens > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(prompt)} tokens + {params.max_tokens} to generate exceeds the model's "
                f"context of {self.max_context}"
            )
        with torch.inference_mode():
            t0 = time.perf_counter()
            cache = self.cache
            # The last prompt token is always computed: its logits pick the first new token.
            match = cache.match(ids[:-1])
            lease = cache.acquire(match)
            new_slots = None
            kv = None
            tokens: list[int] = []
            prefix = match.device_slots
            try:
                load = cache.load_back(match)
                if not load.recompute:
                    prefix = torch.cat([prefix, load.device_slots])
                n_prefix = prefix.numel()
                reload_s = None
                if load.tokens and not load.recompute and self.device.type != "cuda":
                    # On the CPU the copies run on the host anyway: time them on their own.
                    t_load = time.perf_counter()
                    load.wait()
                    reload_s = time.perf_counter() - t_load
                new_slots = cache.alloc_device(len(prompt) - n_prefix + params.max_tokens)
                kv = KVTierCache(
                    self.spec, self.device_pool, prefix, new_slots, None if load.recompute else load
                )
                ttft = 0.0
                first_logits = None
                for token, logits in self._decode(prompt, n_prefix, kv, params):
                    if not tokens:
                        first_logits = logits
                        ttft = time.perf_counter() - t0
                    tokens.append(token)
                    yield token
            finally:
                self._finish(ids, tokens, prefix, kv, new_slots, lease)
        loaded = 0 if load.recompute else load.tokens
        return RequestResult(
            prompt_tokens=len(prompt),
            tokens=tokens,
            text=self.decode(tokens),
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            device_hit_tokens=match.device_tokens,
            host_hit_tokens=match.host_tokens,
            loaded_tokens=loaded,
            loaded_bytes=loaded * self.spec.bytes_per_token(),
            load_s=load.submit_s,
            reload_s=reload_s,
            first_logits=first_logits,
        )

    def _finish(
        self,
        ids: np.ndarray,
        tokens: list[int],
        prefix: torch.Tensor,
        kv: KVTierCache | None,
        new_slots: torch.Tensor | None,
        lease,
    ) -> None:
        """Insert the tokens whose KV is in place, free the other slots, release the lease."""
        cache = self.cache
        try:
            if new_slots is not None:
                written = kv.written if kv is not None else 0
                if written:
                    n = prefix.numel() + written
                    seq = np.concatenate([ids, np.asarray(tokens, dtype=np.int64)])
                    cache.insert(seq[:n], torch.cat([prefix, new_slots[:written]]))
                cache.free_device(new_slots[written:])
        finally:
            cache.release(lease)

    def _decode(
        self, prompt: list[int], n_prefix: int, kv: KVTierCache, params: SamplingParams
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """`(token, logits)` for each new token: the suffix prefill, then one forward per token."""
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=self.device)
            if params.seed is not None:
                gen.manual_seed(params.seed)
        # The uncached suffix in chunks, so attention over a long prompt never builds a
        # prompt-by-prompt mask; only the last chunk's logits are needed.
        for lo in range(n_prefix, len(prompt), self.prefill_chunk):
            hi = min(lo + self.prefill_chunk, len(prompt))
            ids = torch.tensor([prompt[lo:hi]], device=self.device)
            logits = self._forward(ids, torch.arange(lo, hi, device=self.device), kv)
        token = self._pick(logits, params, gen)
        yield token, logits.float().cpu()
        tokens = [token]
        eos = self._eos()
        length = len(prompt)
        while len(tokens) < params.max_tokens and token not in eos and not self._stopped(tokens, params):
            ids = torch.tensor([[token]], device=self.device)
            pos = torch.tensor([length], device=self.device)
            logits = self._forward(ids, pos, kv)
            length += 1
            token = self._pick(logits, params, gen)
            tokens.append(token)
            yield token, logits

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, kv: KVTierCache) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            position_ids=pos.unsqueeze(0),
            cache_position=pos,
            use_cache=True,
            **{self._cache_kw: kv},
        )
        return out.logits[0, -1]

    @staticmethod
    def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        if params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        if params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

    def _eos(self) -> set[int]:
        ids = (
            getattr(self.model.generation_config, "eos_token_id", None)
            if hasattr(self.model, "generation_config")
            else None
        )
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return set()
        return {int(i) for i in (ids if isinstance(ids, list | tuple) else [ids])}

    def _stopped(self, tokens: list[int], params: SamplingParams) -> bool:
        if not params.stop or self.tokenizer is None:
            return False
        tail = self.decode(tokens[-16:])
        return any(s in tail for s in params.stop)
