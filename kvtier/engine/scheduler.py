"""Continuous batching: which requests run in the next step, and how many of their tokens.

`Scheduler` keeps the waiting queue (arrival order; a preempted request goes back to its
front) and the running requests (admission order). Each step (`schedule`) it gives:

1. every running request that is decoding one token, then every one still prefilling a
   piece of its prompt (at most what is left of `max_num_batched_tokens`);
2. then admits waiting requests while fewer than `max_num_seqs` run and the budget
   lasts: a match against the cache (the last prompt token is always computed), a lease
   on it, the slots of its first piece, then the reload of its host part.

A request's context is `prompt + tokens generated`; `computed` of them have KV in the
device slots of its slot table (`table`): `[:cached]` the tree's (locked by its lease),
`[cached:filled]` its own (`alloc_device`), taken a page at a time as it grows. A step
computes `context[computed : computed + n]`; a request whose whole context is then
computed samples its next token.

Memory pressure: when a running request cannot get its next page even after the cache
evicted every unlocked node, the most recently admitted running request younger than it
is preempted (its whole computed pages inserted into the cache, its other slots freed,
its lease released; it resumes from the cache later, as a new prompt of its context);
if none is younger, the request itself goes back to the queue. A request alone that
cannot grow raises `CacheFullError` (the admission check makes that impossible).
Admission never preempts.

A prefix being computed is not computed twice: a waiting request that shares more than
a page beyond a prefilling request's cached part waits until that request has computed
its prompt, whose pages are then inserted (so the later one matches them).

Finish (end of generation, cancellation, timeout): whole computed pages inserted, other
slots freed, lease released; the slot table is empty afterwards. Without a prefix cache
nothing is matched or inserted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.cache import CacheController
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.errors import CacheFullError
from kvtier.slots import NO_SLOTS

if TYPE_CHECKING:
    from kvtier.cache import Lease, LoadHandle, Match

log = logging.getLogger(__name__)


class RequestState(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request from `submit` to its finish; the engine and the scheduler change it."""

    id: int
    prompt: np.ndarray  # `[P]` int64
    params: SamplingParams
    t0: float  # perf_counter at submit
    generator: torch.Generator | None = None
    state: RequestState = RequestState.WAITING
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when `params.logprobs` is set
    first_logits: torch.Tensor | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    # The first admission's match: where the prompt's prefix came from.
    match: Match | None = None
    load_tokens: int = 0
    load_s: float = 0.0
    reload_s: float | None = None
    # While running:
    lease: Lease | None = None
    load: LoadHandle | None = None  # waited for by the next forward's layers
    table: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    cached: int = 0
    filled: int = 0
    computed: int = 0

    @property
    def deadline(self) -> float | None:
        return None if self.params.timeout_s is None else self.t0 + self.params.timeout_s

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def context_len(self) -> int:
        """Tokens whose KV the next token needs: the prompt and every token generated."""
        return len(self.prompt) + len(self.tokens)

    def context(self, n: int | None = None) -> np.ndarray:
        """`[n]` int64: the first `n` context tokens (all by default)."""
        n = self.context_len if n is None else n
        if n <= len(self.prompt):
            return self.prompt[:n]
        return np.concatenate([self.prompt, np.asarray(self.tokens[: n - len(self.prompt)], dtype=np.int64)])

    def token_at(self, i: int) -> int:
        """Context token `i` (of the prompt, else generated)."""
        p = len(self.prompt)
        return int(self.prompt[i]) if i < p else self.tokens[i - p]

    def span(self, lo: int, hi: int) -> np.ndarray:
        """`[hi - lo]` int64: context tokens `[lo, hi)` (`context(hi)[lo:]` without building the context)."""
        p = len(self.prompt)
        if hi <= p:
            return self.prompt[lo:hi]
        tail = np.array(self.tokens[max(lo - p, 0) : hi - p], dtype=np.int64)
        return tail if lo >= p else np.concatenate([self.prompt[lo:], tail])

    @property
    def remaining(self) -> int:
        return self.context_len - self.computed


class Scheduler:
    """Waiting and running requests over `cache`; see the module docstring."""

    def __init__(
        self, cache: CacheController, max_num_seqs: int, max_num_batched_tokens: int, prefix_cache: bool
    ) -> None:
        self.cache = cache
        self.page_size = cache.spec.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages."""
        return -(-tokens // self.page_size) * self.page_size

    # -- a step --------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Request, int]]:
        """`(request, tokens to compute)` of the next step, decodes first; admits as it goes."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        order = sorted(((req, req.remaining) for req in self.running), key=lambda rl: rl[1] > 1)
        self._grow_decodes([req for req, left in order[:budget] if left == 1])
        for req, left in order:  # (`left` holds while the request runs: only a preemption changes it)
            if budget == 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # preempted by an earlier request of this step
            n = min(left, budget)
            if self._grow(req, req.computed + n, plan):
                plan.append((req, n))
                budget -= n
        while budget and self.waiting and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            n = self._admit(req, budget) if req is not None else 0
            if not n:
                break
            plan.append((req, n))
            budget -= n
        plan.sort(key=lambda rn: rn[1] > 1)  # stable: one-token pieces first (`StepBatch`)
        return plan

    def computed(self, req: Request, n: int) -> bool:
        """Record that a step computed `n` more tokens of `req`; True when it samples a token now."""
        req.computed += n
        req.load = None  # the step's layers waited for it
        return req.computed == req.context_len

    def publish(self, req: Request) -> None:
        """Insert `req`'s whole computed pages now (others can match them) and re-lock them."""
        if not self.prefix_cache:
            return
        n = req.computed // self.page_size * self.page_size
        if n <= req.cached:
            return
        node = self.cache.insert(req.context(n), torch.from_numpy(req.table[:n].copy()))
        lease = self.cache.acquire(node)
        self.cache.release(req.lease)
        req.lease = lease
        # Positions another request inserted first keep the tree's slots (ours were freed).
        req.table[:n] = torch.cat([p.device_slots for p in node.path()]).numpy()
        req.cached = n

    def finish(self, req: Request, reason: str) -> None:
        """End `req`: computed pages inserted, other slots freed, lease released (see the docstring)."""
        if req.finished:
            return
        if req.state is RequestState.RUNNING:
            self._stop(req)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.state, req.finish_reason = RequestState.FINISHED, reason

    # -- admission -----------------------------------------------------------------------

    def _next_waiting(self) -> Request | None:
        """The first waiting request that does not share a prefix being computed now."""
        for req in self.waiting:
            if not any(self._computing_shared(req, r) for r in self.running):
                self.waiting.remove(req)
                return req
        return None

    def _computing_shared(self, req: Request, other: Request) -> bool:
        """Whether `other` is prefilling tokens `req` would compute too (over a page beyond its cache)."""
        if not self.prefix_cache or other.computed >= len(other.prompt):
            return False
        a, b, k = req.prompt, other.prompt, other.cached + self.page_size
        if len(a) < k or len(b) < k:
            return False
        # The page past `other`'s cached part first: it tells most prompts apart in O(page).
        return np.array_equal(a[k - self.page_size : k], b[k - self.page_size : k]) and np.array_equal(
            a[:k], b[:k]
        )

    def _admit(self, req: Request, budget: int) -> int:
        """Admit `req`: tokens it computes this step, or 0 (nothing held, back at the queue's front).

        Its cached prefix is matched and locked, then the slots of its first piece are
        taken, and only then is the host part loaded back: a reload never runs for a
        request that cannot start (admission never preempts).
        """
        cache = self.cache
        ctx = req.context()
        match = cache.match(ctx[:-1]) if self.prefix_cache else None
        lease = cache.acquire(match) if match is not None else None
        # What the prefix will be if every page storage holds arrives (if not, `_grow` below).
        expected = match.tokens + match.storage_tokens if match is not None else 0
        piece, load = NO_SLOTS, None
        try:
            piece = cache.alloc_device(self.pages(min(len(ctx) - expected, budget)))
            load = cache.load_back(match) if match is not None else None
        except CacheFullError:
            if len(piece):
                cache.free_device(piece)
            if lease is not None:
                cache.release(lease)
            self.waiting.appendleft(req)
            return 0
        prefix = match.device_slots if match is not None else NO_SLOTS
        if load is not None and not load.recompute and load.tokens:
            prefix = torch.cat([prefix, load.device_slots])
            req.load = load
            if cache.device_pool.device.type != "cuda":
                t = time.perf_counter()  # on the CPU the copies run on the host anyway: time them
                load.wait()
                req.reload_s = (req.reload_s or 0.0) + time.perf_counter() - t
                req.load = None
        if req.match is None and match is not None:
            req.match = match
            req.load_tokens = 0 if load is None or load.recompute else load.tokens
            req.load_s = load.submit_s if load is not None else 0.0
        req.lease = lease
        req.cached = req.computed = int(prefix.numel())
        req.filled = req.cached + len(piece)
        req.table = np.empty(max(self.pages(len(req.prompt) + req.params.max_tokens), req.filled), np.int64)
        req.table[: req.cached] = prefix.numpy()
        req.table[req.cached : req.filled] = piece.numpy()
        req.state = RequestState.RUNNING
        self.running.append(req)
        n = min(req.remaining, budget)
        if not self._grow(req, req.computed + n, [], preempt=False):  # the prefix came out shorter
            self._stop(req)
            self.running.remove(req)
            req.state = RequestState.WAITING
            self.waiting.appendleft(req)
            return 0
        return n

    # -- slots ---------------------------------------------------------------------------

    def _grow(self, req: Request, need: int, plan: list, preempt: bool = True) -> bool:
        """Give `req` slots up to `need` tokens; when short, preempt younger requests (see the docstring)."""
        want = self.pages(need) - req.filled
        if want <= 0:
            return True
        while True:
            try:
                slots = self.cache.alloc_device(want)
                break
            except CacheFullError:
                if not preempt:
                    return False
                victim = self._victim(req)
                if victim is not None:
                    plan[:] = [(r, n) for r, n in plan if r is not victim]
                    self.preempt(victim)
                elif len(self.running) > 1:
                    self.preempt(req)
                    return False
                else:
                    raise
        req.table[req.filled : req.filled + want] = slots.numpy()
        req.filled += want
        return True

    def _grow_decodes(self, reqs: list[Request]) -> None:
        """Give decodes `reqs` (one token each) their next pages in one allocation.

        One call into the cache per step instead of one per request. Where the pool cannot give
        them all even after evicting every unlocked node, none is taken and `_grow` takes them
        request by request, preempting as the module docstring says. The nodes evicted are the
        ones the request-by-request path evicts: the fewest in policy order that cover the
        step's pages, or, when those do not, every one (that path too evicts them all before it
        preempts anyone).
        """
        ps = self.page_size
        wants = [(r, w) for r in reqs if (w := -(-(r.computed + 1) // ps) * ps - r.filled) > 0]
        total = sum(w for _, w in wants)
        if not total:
            return
        try:
            slots = self.cache.alloc_device(total).numpy()
        except CacheFullError:
            return
        at = 0
        for req, w in wants:
            req.table[req.filled : req.filled + w] = slots[at : at + w]
            req.filled += w
            at += w

    def _victim(self, req: Request) -> Request | None:
        """The most recently admitted running request admitted after `req`, if any."""
        younger = self.running[self.running.index(req) + 1 :]
        return younger[-1] if younger else None

    def preempt(self, req: Request) -> None:
        """Move a running request back to the front of the queue; its computed pages go to the cache."""
        self._stop(req)
        self.running.remove(req)
        req.state = RequestState.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
        log.info("request %d preempted at %d tokens (device pool full)", req.id, req.context_len)

    def _stop(self, req: Request) -> None:
        """Insert the whole computed pages, free the request's other slots, release its lease."""
        cache = self.cache
        try:
            n = req.computed // self.page_size * self.page_size if self.prefix_cache else 0
            if n > req.cached:
                cache.insert(req.context(n), torch.from_numpy(req.table[:n].copy()))
            first_own = max(n, req.cached)
            if req.filled > first_own:
                cache.free_device(torch.from_numpy(req.table[first_own : req.filled].copy()))
        finally:
            if req.lease is not None:
                cache.release(req.lease)
            req.lease, req.load = None, None
            req.cached = req.filled = req.computed = 0
