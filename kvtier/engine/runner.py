"""The model's side of an engine's step: one forward over the scheduled pieces, and each next token.

`ModelRunner` is held by `Engine` (`engine.runner`); it keeps no state of its own between steps
(the requests' bookkeeping, the counters and finishing requests are the engine's).

`forward(plan)`: one packed sequence through the model with a step as its cache: every layer
waits for its own layer of the requests' pending loads, writes the new rows to their device
slots and attends each request to its context in the device pool. Two paths, one math: on
CUDA (or with `paged=True` under Triton's interpreter) `PagedStep`, whose kernels read the
pool in place (`kvtier.engine.paged_step`), its decode-only steps replayed from CUDA graphs
unless `enforce_eager` (`kvtier.engine.graphs`); elsewhere `StepBatch`, the reference, which
gathers each context per layer and runs SDPA (`kvtier.engine.batch`). No path reads the
device from the host during the forward. Sliding-window layers (Gemma 2 / 3) keep every token's KV like full
layers and apply the window in the mask: such a model takes the pool memory of a full-attention
model of its shape, and the window saves no memory, only some attention compute
(`kvtier.engine.hf.layer_windows`).

`choose_all(rows, logits)`: the next token of every request that samples this step, picked on
the device over the whole batch (`kvtier.engine.sampling.sample_rows`), then read back with
the logprobs and first logits asked for in one wait (`kvtier.engine.hostio.read_back`): the
step's one synchronisation. Each gets its `Choice` and whether it ends there ("stop": EOS or a
stop string, through the engine's `TextCodec`; "length": `max_tokens`). Where the batched
sampling fails, each request samples alone (`choose`), and one whose sampling fails gets
`Choice(-1, "error", e)`; the other requests of the step go on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch

from kvtier.engine import paged
from kvtier.engine.batch import Piece, StepBatch, kvtier_attention
from kvtier.engine.graphs import DecodeGraphs
from kvtier.engine.hf import layer_windows, text_config
from kvtier.engine.hostio import read_back, to_device
from kvtier.engine.lockstep import Choice
from kvtier.engine.paged_step import HostLayout, PagedStep
from kvtier.engine.sampling import TokenLogprob, pick, sample_rows, token_logprob
from kvtier.engine.scheduler import Request
from kvtier.engine.text import TextCodec
from kvtier.errors import ConfigError
from kvtier.pool import DevicePool
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)


class ModelRunner:
    """Run `model` (a transformers causal LM) over the requests' pieces in `device_pool`; see the
    module docstring."""

    def __init__(
        self,
        model: Any,
        spec: KVSpec,
        device_pool: DevicePool,
        text: TextCodec,
        paged_attention: bool | None = None,
        graphs_up_to: int = 0,
    ) -> None:
        """`paged_attention`: the `PagedStep` path (else `StepBatch`; None: on CUDA); `graphs_up_to`:
        capture decode steps of up to this many requests in CUDA graphs (0: none; CUDA's paged path)."""
        self.model, self.spec, self.device_pool, self.text = model, spec, device_pool, text
        self.windows = layer_windows(model.config)  # `[layers]`: sliding window, None for full attention
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.device = device_pool.device
        self.paged = paged_attention if paged_attention is not None else self.device.type == "cuda"
        if self.paged and not paged.runs_on(self.device):
            raise ConfigError(
                f"paged attention needs Triton on CUDA (or TRITON_INTERPRET=1), not {self.device}"
            )
        cfg = text_config(model.config)
        heads = int(cfg.num_attention_heads)
        kv_heads = (
            1 if getattr(cfg, "kv_lora_rank", None) else int(getattr(cfg, "num_key_value_heads", heads))
        )
        self.groups = (kv_heads, heads // kv_heads)
        self.sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 4
        )
        self.graphs = (
            DecodeGraphs(spec, device_pool, self.windows, self._run, graphs_up_to, self.groups)
            if self.paged and graphs_up_to and self.device.type == "cuda"
            else None
        )

    def forward(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        """`[R, V]` logits of each piece's last token after one forward over the whole plan.

        `plan`: `(request, n)` per running request, `n` its tokens computed this step.
        """
        if self.paged:
            return self._forward_paged(plan)
        pieces, ids = [], []
        for req, n in plan:
            lo = req.computed
            pieces.append(Piece(torch.from_numpy(req.table[: lo + n]), n, req.load))
            ids.append(req.span(lo, lo + n))
        input_ids = torch.from_numpy(np.concatenate(ids)).to(self.device_pool.device).unsqueeze(0)
        batch = StepBatch(self.spec, self.device_pool, pieces, self.windows, input_ids[0])
        pos = batch.positions
        kw = {self._cache_kw: batch}
        with kvtier_attention(self.model.config), batch.active():
            out = self.model(
                input_ids=input_ids,
                position_ids=pos.unsqueeze(0),
                cache_position=pos,
                use_cache=True,
                logits_to_keep=batch.last,
                **kw,
            )
        return out.logits[0]

    def _forward_paged(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        pieces = [(req.table[: req.computed + n], n) for req, n in plan]
        host = HostLayout.of(pieces, _tokens(plan))
        loads = [req.load for req, _ in plan if req.load is not None]
        if self.graphs is not None and self.graphs.takes(host, len(loads)):
            logits = self.graphs.run(host)
            if logits is not None:
                return logits
        hkv, group = self.groups
        width = host.arrays["dec_table"].shape[1]
        programs = len(host.arrays["dec_lens"]) * hkv * -(-group // 64)
        splits = paged.decode_splits(programs, width, paged.decode_block(128), self.sms)
        return self._run(
            PagedStep(self.spec, self.device_pool, host.stage(self.device), self.windows, loads, splits)
        )

    def _run(self, step: PagedStep) -> torch.Tensor:
        """`[R, V]` logits of `step`'s forward (its metadata already on the device)."""
        lay = step.layout
        with kvtier_attention(self.model.config), step.active():
            out = self.model(
                input_ids=lay.ids.unsqueeze(0),
                position_ids=lay.positions.unsqueeze(0),
                cache_position=lay.positions,
                use_cache=True,
                logits_to_keep=lay.last,
                **{self._cache_kw: step},
            )
        return out.logits[0]

    def choose_all(self, rows: list[tuple[Request, int]], logits: torch.Tensor) -> list[Choice]:
        """Each `(request, row of logits)`'s next token and whether the request ends there; one
        read from the device for all (see the module docstring). Sets `first_logits` and appends
        `logprobs` where asked."""
        if not rows:
            return []
        reqs = [req for req, _ in rows]
        if len(rows) == logits.shape[0] and all(i == j for j, (_, i) in enumerate(rows)):
            sub = logits  # every row samples, in order: no gather
        else:
            sub = logits.index_select(0, to_device(np.array([i for _, i in rows], np.int64), logits.device))
        try:
            tokens = sample_rows(
                sub, [r.params for r in reqs], [r.generator for r in reqs], [r.tokens for r in reqs]
            )
        except Exception:  # the batch could not sample: each request alone, its failure its own
            log.exception("batched sampling failed; sampling each request alone")
            return [self._alone(req, logits[i]) for req, i in rows]
        firsts = [j for j, r in enumerate(reqs) if not r.tokens]
        asks = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
        fetch = [tokens]
        if firsts:
            fetch.append(sub.index_select(0, to_device(np.array(firsts), sub.device)).float())
        if asks:
            at = to_device(np.array(asks), sub.device)
            logp = torch.log_softmax(sub.index_select(0, at).float(), dim=-1)
            k = max(1, max(reqs[j].params.logprobs for j in asks))
            top = torch.topk(logp, min(k, logp.shape[-1]))
            fetch += [logp.gather(1, tokens.index_select(0, at).unsqueeze(1)), top.values, top.indices]
        host = read_back(fetch)
        for n, j in enumerate(firsts):
            reqs[j].first_logits = host[1][n]
        if asks:
            chosen, values, ids = host[-3:]
            for n, j in enumerate(asks):
                k = reqs[j].params.logprobs
                top = tuple(zip(ids[n, :k].tolist(), values[n, :k].tolist(), strict=True)) if k else ()
                reqs[j].logprobs.append(TokenLogprob(int(host[0][j]), float(chosen[n, 0]), top))
        return [Choice(t, self.finish_reason(r, t)) for r, t in zip(reqs, host[0].tolist(), strict=True)]

    def _alone(self, req: Request, logits: torch.Tensor) -> Choice:
        if not req.tokens:
            req.first_logits = logits.float().cpu()
        return self.choose(req, logits, int(logits.argmax()))

    def choose(self, req: Request, logits: torch.Tensor, greedy: int) -> Choice:
        """`req`'s next token from its `[V]` logits (`greedy`: their argmax) and whether it ends there."""
        p = req.params
        try:
            sampled = p.temperature != 0 or p.penalized
            token = pick(logits, p, req.generator, req.tokens) if sampled else greedy
            if p.logprobs is not None:
                req.logprobs.append(token_logprob(logits, token, p.logprobs))
        except Exception as e:  # this request's sampling failed: the others of the step go on
            log.exception("sampling request %d failed", req.id)
            return Choice(-1, "error", e)
        return Choice(token, self.finish_reason(req, token))

    def finish_reason(self, req: Request, token: int) -> str | None:
        """Why `req` ends once `token` is appended to its tokens (None: it goes on)."""
        p = req.params
        if (not p.ignore_eos and token in self.text.eos) or (
            p.stop and self.text.stopped([*req.tokens[-p.stop_window :], token], p)
        ):
            return "stop"  # before "length": a stop on the last token allowed is still a stop
        if len(req.tokens) + 1 >= p.max_tokens:
            return "length"
        return None


def _tokens(plan: list[tuple[Request, int]]) -> np.ndarray:
    """`[T]` int64: the tokens each `(request, n)` computes this step, packed in plan order."""
    if all(n == 1 for _, n in plan):  # a decode-only step: one token each, no array per request
        return np.array([req.token_at(req.computed) for req, _ in plan], np.int64)
    return np.concatenate([req.span(req.computed, req.computed + n) for req, n in plan])
