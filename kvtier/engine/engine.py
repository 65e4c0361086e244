"""The engine: many requests at once over a transformers causal LM and kvtier's tiered cache.

`submit(prompt, params)` queues a request (refused at once, before the cache is touched,
with `PromptTooLongError` when it cannot fit the model's context or the whole device
pool even alone); `step()` runs one forward over every running request (the
`Scheduler` picks the decodes, the prefill pieces and the requests it admits, under
`max_num_batched_tokens` and `max_num_seqs`) and returns an `Update` per request that
got a token or finished; `cancel(req)` finishes one now. `generate` / `stream` drive
the engine themselves for one request.

The engine holds its collaborators, one job each: the `Scheduler` (which requests run and
their slots), the `ModelRunner` (`kvtier.engine.runner`: each forward over the packed
pieces, and each next token and whether it ends the request) and the `TextCodec`
(`kvtier.engine.text`: the tokenizer, chat template, EOS and stop strings; `encode_chat`,
`decode`, `token_text` and `chat_template` are its, on the engine too). The engine itself
keeps the requests' lifecycle and counters. A finished request's whole computed pages are
inserted into the cache, its other slots freed and its lease released, whatever ended
it (length, EOS or a stop string, cancellation, timeout, a failed step). A result's `text`
ends just before its first stop string; its `tokens` are every token generated.

Storage (`storage=URL` or a `StorageConfig`): a third tier below the host, keyed by the
model's identity (`model_name`, else the config's name or path) and its config, so a
restarted engine or another process over the same store finds the prefixes computed
before (see `kvtier.cache.storage_tier`).

Tensor parallelism (`ranks` of two or more): `model` is this rank's shard (`load_model`
with `ranks`), the spec this rank's (`spec_from_hf_config`); rank 0 is driven as any engine
and every other rank runs `follow()` in lockstep with it (`kvtier.engine.lockstep`).

Threads: an engine is driven from one thread at a time (the server's worker); its
counters (`num_running`, `num_waiting`, `stats`) may be read from any.

Lifetime: the engine owns its cache, both pools and the storage tier; `close()` (or leaving
a `with` block) drains the cache's transfers, finishes pending storage writes and releases
the pools' memory at once. The model is the caller's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch

from kvtier.cache import CacheConfig, token_ids
from kvtier.cache.ranks import RankGroup
from kvtier.cache.storage_mover import open_storage
from kvtier.engine.hf import model_config_identity, model_identity, spec_from_hf_config, text_config
from kvtier.engine.lockstep import Lockstep, ranked_cache
from kvtier.engine.results import EngineStats, RequestResult, Update
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Request, Scheduler
from kvtier.engine.text import TextCodec
from kvtier.errors import ClosedError, ConfigError, InvariantError, PromptTooLongError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.memory import Owner
from kvtier.storage.config import StorageConfig

log = logging.getLogger(__name__)

# Tokens per page when a storage tier is on and no page size is given.
STORAGE_PAGE_SIZE = 64


class Engine(Owner):
    """Serve `model` (a transformers causal LM) through kvtier's tiered cache.

    `device_tokens` / `host_tokens`: KV pool sizes of the two tiers (multiples of the page
    size). `max_num_batched_tokens`: tokens one step computes at most (prompt pieces and
    decode tokens together); `max_num_seqs`: requests running at once; `prefix_cache`:
    match and insert prefixes (off: every request computes its whole prompt).
    `page_size`: tokens per page of every tier (the cache matches and keeps whole pages);
    by default 1, or `STORAGE_PAGE_SIZE` with a storage tier, whose values are one page
    each (a one-token value is far too small to read at the store's rate: bench/FINDINGS.md).
    `ranks`: the tensor-parallel ranks `model` is sharded over (see the module docstring;
    None: one process). `paged_attention` (default: on CUDA) and `enforce_eager` (no CUDA
    graphs): `kvtier.engine.runner`. A context manager.
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
        ranks: RankGroup | None = None,
        paged_attention: bool | None = None,
        enforce_eager: bool = False,
    ) -> None:
        ranks = ranks or RankGroup.single()
        sharded = getattr(model, "tp_size", None) or 1  # transformers' tensor-parallel size
        if sharded != ranks.world:
            raise ConfigError(f"the model is sharded over {sharded} ranks, the group has {ranks.world}")
        if isinstance(storage, str):
            storage = StorageConfig(storage)
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ConfigError(
                f"max_num_batched_tokens, max_num_seqs must be > 0: {max_num_batched_tokens}, {max_num_seqs}"
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
        self._ids = itertools.count(1)
        self.model = model.eval()
        self.text = TextCodec(tokenizer, getattr(model, "generation_config", None))
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.spec = spec_from_hf_config(model.config, dtype=dtype, page_size=ps, tp=ranks.world)
        self.ranks = ranks
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # the ids a prompt may hold
        self.max_context = int(getattr(text_config(model.config), "max_position_embeddings", 0) or 0)
        self.device_pool = DevicePool(self.spec, device_tokens, self.device)
        with ExitStack() as undo:  # a failure below closes the pools made so far
            undo.callback(self.device_pool.close)
            self.host_pool = HostPool(self.spec, host_tokens, host_layout)
            undo.callback(self.host_pool.close)
            self.storage = None
            if storage is not None:
                name = model_name or storage.model or model_identity(model.config)
                fingerprint = ranks.fingerprint(name, self.spec, model_config_identity(model.config))
                self.storage = open_storage(storage, self.host_pool, fingerprint)
                undo.callback(self.storage.close)
            self.cache = ranked_cache(self.device_pool, self.host_pool, config, self.storage, ranks)
            self.lockstep = Lockstep(ranks) if ranks.world > 1 else None
            undo.pop_all()
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, prefix_cache)
        graphs = 0 if enforce_eager or ranks.world > 1 else max_num_seqs
        self.runner = ModelRunner(self.model, self.spec, self.device_pool, self.text, paged_attention, graphs)

    @property
    def num_running(self) -> int:
        """Requests holding device slots now (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted (or preempted and waiting to resume)."""
        return len(self.scheduler.waiting)

    @property
    def busy(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.scheduler.running or self.scheduler.waiting)

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
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
        }

    def close(self) -> None:
        """Drain the cache's transfers, then release both pools' memory; idempotent.

        A request still streaming fails with `ClosedError` at its next token.
        """
        if self._closed:
            return
        self._closed = True
        if self.lockstep is not None:
            self.lockstep.closing()
        try:
            self.cache.close()  # drains its lanes and closes both pools
        finally:
            self.host_pool.close()  # idempotent: closed even where the cache's close failed
            self.device_pool.close()
        log.info("engine for %s closed", self.spec.name)

    def settle(self) -> None:
        """Run the cache's pending transfers and backups now (every rank's, in lockstep)."""
        if self.lockstep is not None:
            self.lockstep.settling()
        self.cache.settle()

    def follow(self, on_update: Callable[[Update], None] | None = None) -> None:
        """On a rank other than 0: replay rank 0's calls until it closes this engine too.

        `on_update`: called with each replayed step's updates (the tokens rank 0's got).
        """
        if self.lockstep is None:
            raise InvariantError("follow() needs an engine over two ranks or more")
        self.lockstep.follow(self, on_update)

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None) -> RequestResult:
        """Run one request on prompt token ids to the end; see `stream`."""
        stream = self.stream(prompt, params)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(
        self, prompt: Sequence[int], params: SamplingParams | None = None
    ) -> Generator[int, None, RequestResult]:
        """Submit one request and step the engine until it finishes, yielding its tokens.

        Steps run every request submitted, but only this one's tokens are yielded: drive a
        shared engine through `submit` / `step` instead. Closing the generator early
        cancels the request (computed pages inserted, slots freed, lease released).
        """
        req = self.submit(prompt, params)
        try:
            while True:
                for u in self.step():
                    if u.request is not req:
                        continue
                    if u.error is not None:
                        raise u.error
                    if u.token is not None:
                        yield u.token
                    if u.result is not None:
                        return u.result
        finally:
            if not req.finished:
                self.cancel(req)

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a request on prompt token ids; refused at once (nothing changed) if it cannot fit.

        `ConfigError` for an empty prompt or a token id outside the vocabulary,
        `PromptTooLongError` when prompt + `max_tokens` exceed the model's context or the
        whole device pool, `ClosedError` after `close`.
        """
        if self._closed:
            raise ClosedError(f"engine for {self.spec.name} was closed")
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, params)
        req = Request(next(self._ids), ids, params, time.perf_counter(), params.generator(self.device))
        if self.lockstep is not None:
            self.lockstep.submitted(req)
        self.scheduler.waiting.append(req)
        self.stats.prompt_tokens += len(ids)
        log.debug("request %d: %d prompt tokens, up to %d new", req.id, len(ids), params.max_tokens)
        return req

    def cancel(self, req: Request) -> RequestResult:
        """Finish `req` now (computed pages inserted, slots freed, lease released); idempotent."""
        if not req.finished:
            if self.lockstep is not None:
                self.lockstep.cancelled(req)
            self._end(req, "cancelled")
        return self._result(req)

    def step(self) -> list[Update]:
        """One forward over the running requests (admitting waiting ones first); what each got.

        Requests past their `timeout_s` finish first ("timeout"). A forward that fails
        finishes every request in it with the error (`Update.error`); the engine goes on.
        """
        if self._closed:
            raise ClosedError(f"engine for {self.spec.name} was closed")
        updates = self._expire()
        with torch.inference_mode():
            plan = self.scheduler.schedule()
            self.stats.preemptions = self.scheduler.preemptions  # (only `schedule` preempts)
            if not plan:
                return updates
            if self.lockstep is not None:
                self.lockstep.same_plan(plan)
            try:
                logits = self.runner.forward(plan)
            except Exception as e:
                log.exception("a step over %d requests failed", len(plan))
                for req, _ in plan:
                    self._end(req, "error")
                    updates.append(Update(req, error=e))
                return updates
            return updates + self._advance(plan, logits)

    # -- a step ------------------------------------------------------------------------

    def _expire(self) -> list[Update]:
        now = time.perf_counter()
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        late = [r for r in queued if r.deadline is not None and now > r.deadline]
        if self.lockstep is not None:  # rank 0's clock decides
            ids = set(self.lockstep.late([r.id for r in late]))
            late = [r for r in queued if r.id in ids]
        for req in late:
            self._end(req, "timeout")
        return [Update(req, result=self._result(req)) for req in late]

    def _advance(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> list[Update]:
        """Record what the step computed; sample the requests whose context is complete."""
        sched, updates = self.scheduler, []
        done = [(i, req, n) for i, (req, n) in enumerate(plan) if sched.computed(req, n)]
        mine = None
        if self.lockstep is None or self.lockstep.leads:  # one read from the device for the step
            mine = self.runner.choose_all([(req, i) for i, req, _ in done], logits)
        choices = mine if self.lockstep is None else self.lockstep.choices(mine)
        now = time.perf_counter()
        for (i, req, n), c in zip(done, choices, strict=True):
            if c.reason == "error":
                self._end(req, "error")
                updates.append(Update(req, error=c.error or InvariantError(f"rank 0 failed on {req.id}")))
                continue
            if mine is None and not req.tokens:  # (a follower: the leader's `choose_all` sets its own)
                req.first_logits = logits[i].float().cpu()
            if n > 1 or not req.tokens:
                sched.publish(req)  # its prompt's pages, for requests arriving meanwhile
            req.tokens.append(c.token)
            req.token_times.append(now)
            self.stats.generation_tokens += 1
            if c.reason is not None:
                self._end(req, c.reason)
            updates.append(Update(req, c.token, self._result(req) if c.reason is not None else None))
        return updates

    def _end(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    # -- requests ----------------------------------------------------------------------

    def _prompt_ids(self, prompt: Sequence[int], params: SamplingParams) -> np.ndarray:
        """`[P]` int64 ids of a prompt that fits; `ConfigError` / `PromptTooLongError` otherwise."""
        ids = token_ids(prompt, copy=True)  # the cache matches and inserts arrays
        if not len(ids):
            raise ConfigError("a prompt needs at least one token, got an empty one")
        ids = ids.astype(np.int64, copy=False)
        need = len(ids) + params.max_tokens
        if self.max_context and need > self.max_context:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + {params.max_tokens} to generate exceeds the model's "
                f"context of {self.max_context}"
            )
        need = self.scheduler.pages(need)
        if need > self.device_pool.num_slots:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens + {params.max_tokens} to generate needs {need} device "
                f"slots; the device pool has {self.device_pool.num_slots}"
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            raise ConfigError(f"token ids must be in [0, {self.vocab_size}), got {bad}")
        return ids

    def _result(self, req: Request) -> RequestResult:
        return RequestResult.of(req, self.text.answer(req), self.spec.bytes_per_token())

    # -- text: the `TextCodec`'s, on the engine too ----------------------------------

    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer (None: token ids only)."""
        return self.text.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template, None where it has none (`TextCodec.chat_template`)."""
        return self.text.chat_template

    @chat_template.setter
    def chat_template(self, template: str) -> None:
        self.text.chat_template = template

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the generation prompt appended (`TextCodec.encode_chat`)."""
        return self.text.encode_chat(messages)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, special tokens skipped ("" without a tokenizer)."""
        return self.text.decode(tokens)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (for logprobs)."""
        return self.text.token_text(token)
