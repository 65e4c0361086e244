"""The model's side of an engine's step: one forward over the scheduled pieces, and each next token.

`ModelRunner` is held by `Engine` (`engine.runner`); it keeps no state of its own between steps
(the requests' bookkeeping, the counters and finishing requests are the engine's).

`forward(plan)`: one packed sequence through the model with `StepBatch` as its cache: every
layer waits for its own layer of the requests' pending loads, writes the new rows to their
device slots and attends each request to its context where it lives in the device pool
(`kvtier.engine.batch`). Sliding-window layers (Gemma 2 / 3) keep every token's KV like full
layers and apply the window in the mask: such a model takes the pool memory of a full-attention
model of its shape, and the window saves no memory, only some attention compute
(`kvtier.engine.hf.layer_windows`).

`choose(req, logits, greedy)`: a request's next token (greedy, sampled or penalised, with its
logprob where asked) and whether the request ends there ("stop": EOS or a stop string, through
the engine's `TextCodec`; "length": `max_tokens`). A request whose sampling fails gets
`Choice(-1, "error", e)`; the other requests of the step go on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch

from kvtier.engine.batch import Piece, StepBatch, kvtier_attention
from kvtier.engine.hf import layer_windows
from kvtier.engine.lockstep import Choice
from kvtier.engine.sampling import pick, token_logprob
from kvtier.engine.scheduler import Request
from kvtier.engine.text import TextCodec
from kvtier.pool import DevicePool
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)


class ModelRunner:
    """Run `model` (a transformers causal LM) over the requests' pieces in `device_pool`; see the
    module docstring."""

    def __init__(self, model: Any, spec: KVSpec, device_pool: DevicePool, text: TextCodec) -> None:
        self.model, self.spec, self.device_pool, self.text = model, spec, device_pool, text
        self.windows = layer_windows(model.config)  # `[layers]`: sliding window, None for full attention
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        """`[R, V]` logits of each piece's last token after one forward over the whole plan.

        `plan`: `(request, n)` per running request, `n` its tokens computed this step.
        """
        pieces, ids = [], []
        for req, n in plan:
            lo = req.computed
            pieces.append(Piece(torch.from_numpy(req.table[: lo + n]), n, req.load))
            ids.append(req.context(lo + n)[lo:])
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
