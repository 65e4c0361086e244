"""The request loop: prompt -> cache match -> load back -> prefill of the suffix -> decode -> insert.

`Engine` runs one request at a time over a transformers causal LM and a
`CacheController`: it matches the prompt against the cache, locks the match, loads back
what is only on the host (each layer of the forward waits for its own layer of the
load), prefills only the uncached suffix in chunks of `prefill_chunk` tokens, decodes,
inserts the sequence whose KV was computed and releases its lock. A request that fails
leaves the cache consistent (its slots go back, its lease is released); one that cannot
fit the model's context or the device pool is refused with `PromptTooLongError` before
the cache is touched. Per-request state lives in a `_Request`, so batching stays possible.

Storage (`storage=URL` or a `StorageConfig`): a third tier below the host, keyed by the
model's identity (`model_name`, else the config's name or path) and its config, so a
restarted engine or another process over the same store finds the prefixes computed
before (see `kvtier.cache.storage_tier`).

Lifetime: the engine owns its cache, both pools and the storage tier; `close()` (or leaving
a `with` block) drains the cache's transfers, finishes pending storage writes and releases
the pools' memory at once. The model is the caller's.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.cache import CacheConfig, CacheController, token_ids
from kvtier.cache.storage_mover import open_storage
from kvtier.engine.hf import (
    KVTierCache,
    model_config_identity,
    model_identity,
    spec_from_hf_config,
    text_config,
)
from kvtier.errors import ClosedError, ConfigError, PromptTooLongError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.memory import Owner
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint

if TYPE_CHECKING:
    from kvtier.cache import Lease, LoadHandle, Match

log = logging.getLogger(__name__)

# Tokens per page when a storage tier is on and no page size is given.
STORAGE_PAGE_SIZE = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy when `temperature == 0`."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    timeout_s: float | None = None  # from `submit`; a request past it ends with finish_reason "timeout"
    ignore_eos: bool = False  # generate `max_tokens` whatever the model says (benchmarks)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )


@dataclass
class RequestResult:
    """What one request did: its tokens, text and where its prefix came from.

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


@dataclass(eq=False)
class _Request:
    """One request's state between its start and its `_finish` (the engine keeps none)."""

    ids: np.ndarray  # `[P]` int64 prompt ids, as the cache matches them
    prompt: list[int]
    params: SamplingParams
    t0: float
    match: Match
    lease: Lease
    load: LoadHandle | None = None
    prefix: torch.Tensor | None = None  # `[n_prefix]` int64 device slots of the cached prefix
    reload_s: float | None = None
    new_slots: torch.Tensor | None = None  # `[N]` int64 device slots for the tokens computed
    kv: KVTierCache | None = None
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    first_logits: torch.Tensor | None = None

    def add(self, token: int, logits: torch.Tensor) -> None:
        if not self.tokens:
            self.first_logits = logits
            self.ttft_s = time.perf_counter() - self.t0
        self.tokens.append(token)


class Engine(Owner):
    """Serve `model` (a transformers causal LM) through kvtier's tiered cache.

    `device_tokens` / `host_tokens`: KV pool sizes of the two tiers (multiples of the page
    size); `prefill_chunk`: the longest piece of a prompt one forward pass computes.
    `page_size`: tokens per page of every tier (the cache matches and keeps whole pages);
    by default 1, or `STORAGE_PAGE_SIZE` with a storage tier, whose values are one page
    each (a one-token value is far too small to read at the store's rate: bench/FINDINGS.md).
    A context manager.
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
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        prefix_cache: bool = True,
        storage: StorageConfig | str | None = None,
        model_name: str | None = None,
        page_size: int | None = None,
    ) -> None:
        if isinstance(storage, str):
            storage = StorageConfig(storage)
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ConfigError(
                f"max_num_batched_tokens and max_num_seqs must be positive, got {max_num_batched_tokens}, "
                f"{max_num_seqs}"
            )
        ps = page_size if page_size is not None else (STORAGE_PAGE_SIZE if storage is not None else 1)
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        if device_tokens % ps or host_tokens % ps:
            raise ConfigError(
                f"device_tokens ({device_tokens}) and host_tokens ({host_tokens}) must be multiples of "
                f"the page size ({ps})"
            )
        self.page_size = ps
        self.stats = EngineStats()
        self._running = 0
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prefix_cache = prefix_cache
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.spec = spec_from_hf_config(model.config, dtype=dtype, page_size=ps)
        self.max_context = int(getattr(text_config(model.config), "max_position_embeddings", 0) or 0)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device_pool = DevicePool(
            self.spec, device_tokens, self.device, staging_tokens=min(device_tokens, 4096 // ps * ps or ps)
        )
        with ExitStack() as undo:  # a failure below closes the pools made so far
            undo.callback(self.device_pool.close)
            self.host_pool = HostPool(self.spec, host_tokens, host_layout)
            undo.callback(self.host_pool.close)
            self.storage = None
            if storage is not None:
                name = model_name or storage.model or model_identity(model.config)
                fingerprint = Fingerprint.of(name, self.spec, model_config_identity(model.config))
                self.storage = open_storage(storage, self.host_pool, fingerprint)
                undo.callback(self.storage.close)
            self.cache = CacheController(self.device_pool, self.host_pool, config, storage=self.storage)
            undo.pop_all()

    @property
    def num_running(self) -> int:
        """Requests holding device slots now (prefilling or decoding)."""
        return self._running

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (or preempted and waiting to resume)."""
        return 0

    def summary(self) -> dict[str, Any]:
        """What the engine runs: model, dtype, both pools in tokens and bytes, KV bytes per token."""
        per_token = self.spec.bytes_per_token()
        return {
            "model": self.spec.name,
            "dtype": str(self.spec.buffers[0].dtype).removeprefix("torch."),
            "device": str(self.device),
            "kv_bytes_per_token": per_token,
            "device_pool_tokens": self.device_pool.num_slots,
            "device_pool_bytes": self.device_pool.num_slots * per_token,
            "host_pool_tokens": self.host_pool.num_slots,
            "host_pool_bytes": self.host_pool.num_slots * per_token,
            "page_size": self.page_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }

    def close(self) -> None:
        """Drain the cache's transfers, then release both pools' memory; idempotent.

        A request still streaming fails with `ClosedError` at its next token.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.cache.close()  # drains its lanes and closes both pools
        finally:
            self.host_pool.close()  # idempotent: closed even where the cache's close failed
            self.device_pool.close()
        log.info("engine for %s closed", self.spec.name)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the generation prompt appended (the tokenizer's template)."""
        if self.tokenizer is None:
            raise ConfigError("encode_chat needs a tokenizer: build the engine with one")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True) if self.tokenizer else ""

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

        Closing the generator early stops decoding: what was computed is inserted, every
        other slot freed and the lease released.
        """
        if self._closed:
            raise ClosedError(f"engine for {self.spec.name} was closed")
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, params)
        log.debug("request: %d prompt tokens, up to %d new", len(ids), params.max_tokens)
        with torch.inference_mode():
            req = self._start(ids, params)
            try:
                self._load_prefix(req)
                n_prefix = req.prefix.numel()
                req.new_slots = self.cache.alloc_device(
                    self._pages(len(req.prompt) - n_prefix + params.max_tokens)
                )
                load = None if req.load.recompute else req.load
                req.kv = KVTierCache(self.spec, self.device_pool, req.prefix, req.new_slots, load)
                for token, logits in self._decode(req.prompt, n_prefix, req.kv, params):
                    req.add(token, logits)
                    yield token
            finally:
                self._finish(req)
        result = self._result(req)
        log.debug(
            "request done: %d tokens, hit %s (%d on the device, %d from the host), TTFT %.1f ms",
            len(result.tokens),
            result.hit,
            result.device_hit_tokens,
            result.host_hit_tokens,
            result.ttft_s * 1e3,
        )
        return result

    def _prompt_ids(self, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
        """`[P]` int64 ids of a prompt that fits; `ConfigError` / `PromptTooLongError` otherwise."""
        ids = token_ids(prompt)  # the cache matches and inserts arrays; decoding uses the list
        if not len(ids):
            raise ConfigError("a prompt needs at least one token, got an empty one")
        need = len(ids) + params.max_tokens
        if self.max_context and need > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + {params.max_tokens} to generate exceeds the model's "
                f"context of {self.max_context}"
            )
        need = self._pages(need)
        if need > self.device_pool.num_slots:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + {params.max_tokens} to generate needs {need} device "
                f"slots; the device pool has {self.device_pool.num_slots}"
            )
        return ids

    def _pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages."""
        return -(-tokens // self.page_size) * self.page_size

    def _start(self, ids: np.ndarray, params: SamplingParams) -> _Request:
        """Match the prompt and lock the match (released by `_finish`)."""
        t0 = time.perf_counter()
        # The last prompt token is always computed: its logits pick the first new token.
        match = self.cache.match(ids[:-1])
        lease = self.cache.acquire(match)
        return _Request(ids, ids.tolist(), params, t0, match, lease, prefix=match.device_slots)

    def _load_prefix(self, req: _Request) -> None:
        """Load back what of the match is only on the host; the prefix is then resident plus loaded."""
        req.load = load = self.cache.load_back(req.match)
        if not load.recompute:
            req.prefix = torch.cat([req.prefix, load.device_slots])
        if load.tokens and not load.recompute and self.device.type != "cuda":
            # On the CPU the copies run on the host anyway: time them on their own.
            t_load = time.perf_counter()
            load.wait()
            req.reload_s = time.perf_counter() - t_load

    def _finish(self, req: _Request) -> None:
        """Insert the tokens whose KV is in place, free the other slots, release the lease."""
        cache = self.cache
        try:
            if req.new_slots is not None:
                written = req.kv.written if req.kv is not None else 0
                kept = (req.prefix.numel() + written) // self.page_size * self.page_size - req.prefix.numel()
                if kept > 0:  # the whole pages computed; a page's tail is recomputed when next needed
                    n = req.prefix.numel() + kept
                    seq = np.concatenate([req.ids, np.asarray(req.tokens, dtype=np.int64)])
                    cache.insert(seq[:n], torch.cat([req.prefix, req.new_slots[:kept]]))
                cache.free_device(req.new_slots[max(kept, 0) :])
        finally:
            cache.release(req.lease)

    def _result(self, req: _Request) -> RequestResult:
        load = req.load
        loaded = 0 if load.recompute else load.tokens
        return RequestResult(
            prompt_tokens=len(req.prompt),
            tokens=req.tokens,
            text=self.decode(req.tokens),
            ttft_s=req.ttft_s,
            total_s=time.perf_counter() - req.t0,
            device_hit_tokens=req.match.device_tokens,
            host_hit_tokens=req.match.host_tokens,
            loaded_tokens=loaded,
            storage_hit_tokens=req.match.storage_tokens_used,
            loaded_bytes=loaded * self.spec.bytes_per_token(),
            load_s=load.submit_s,
            reload_s=req.reload_s,
            first_logits=req.first_logits,
        )

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
        for lo in range(n_prefix, len(prompt), self.max_num_batched_tokens):
            hi = min(lo + self.max_num_batched_tokens, len(prompt))
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
        kw = {self._cache_kw: kv}
        out = self.model(
            input_ids=ids, position_ids=pos.unsqueeze(0), cache_position=pos, use_cache=True, **kw
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
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
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
