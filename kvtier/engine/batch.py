"""One step's forward over many requests, reading and writing KV where it lives in the device pool.

This is the reference path (the CPU's): it gathers each context per layer and runs SDPA. On CUDA
the engine runs `kvtier.engine.paged_step.PagedStep` instead, the same math with kernels that
read the pool in place; `attend` below serves both (whichever step is active).

A step packs the tokens of every scheduled request into one sequence (`[1, T]`): a
decode request brings its one new token, a prefilling request a piece of its prompt.
`StepBatch` is the transformers `Cache` of that forward: at layer i it waits for the
layer's share of every request's pending load, writes each new token's rows to the
request's device slots (`write_index`), and gathers every request's whole context
(cached prefix, tokens computed before, this step's) from the pool (`read_index`), a
transient per-layer buffer. No request keeps a copy of its KV outside the pool. A
spec with a DSA indexer buffer gets each new token's indexer row on each of its layers
from `kvtier.engine.indexer.standin_rows` (the model computes no index keys; that
module says why the rows exist and what they hold).

`attend` (registered with transformers as the attention implementation `"kvtier"`) then
attends each request to its own context only: the leading pieces with one new token
(decodes) in one padded call, keys past a request's length masked; every other piece
alone with its causal mask offset by the tokens before it. Outside a step (no active
batch) it is transformers' own SDPA, so a model switched to it still runs on its own
(with transformers' masks: `"kvtier"` is registered as a mask implementation too, which
builds SDPA's masks outside a step and none inside one, where `attend` makes its own).

Per layer (`module.layer_idx`), two things the model's attention call carries change the
math: a sliding window (`windows[layer]`, from the config at engine build,
`kvtier.engine.hf.layer_windows`): a query at position p sees the keys at positions in
`(p - window, p]`, as transformers' masks; and Gemma 2's attention logit soft-capping
(`softcap` in the call's kwargs: `tanh(scores / cap) * cap` before the mask), which SDPA
cannot do, so those calls run an explicit matmul-softmax (transformers' eager math, also
outside a step). A sliding layer keeps every token's KV in the pool like a full layer:
the window saves compute (a prefill piece's keys before its first query's window are
sliced off; decodes are masked), never memory. Attention sinks (`s_aux`) and
bidirectional attention are refused (`InvariantError`).

The step's layout (`read_index`):
    [decode 0: Lmax slots][decode 1: Lmax slots]...[piece k: L_k slots]...
A decode shorter than `Lmax` is padded with its own first slot (masked out).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvtier.engine.indexer import on_layer, token_rows
from kvtier.errors import InvariantError
from kvtier.pool import DevicePool
from kvtier.spec import BufferKind, KVSpec

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, DynamicLayer
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:  # pragma: no cover - the engine extra is not installed
    AttentionInterface = None  # type: ignore[assignment,misc]
    AttentionMaskInterface = None  # type: ignore[assignment,misc]
    Cache = object  # type: ignore[assignment,misc]
    DynamicLayer = object  # type: ignore[assignment,misc]

ATTENTION = "kvtier"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The step `attend` serves: a `StepBatch`, or a `kvtier.engine.paged_step.PagedStep`.
_active: contextvars.ContextVar[Any] = contextvars.ContextVar("kvtier_step", default=None)


@contextmanager
def stepping(step: Any) -> Iterator[Any]:
    """Make `attend` call `step.attend` within the block (for the current thread or task)."""
    token = _active.set(step)
    try:
        yield step
    finally:
        _active.reset(token)


@dataclass(frozen=True)
class Piece:
    """One request's part of a step.

    `slots`: `[L]` int64 CPU, the device slots of the request's context in order, this
    step's `new` tokens last. `load`: a load handle whose `wait_layer(i)` must pass
    before layer i reads the context, or None.
    """

    slots: torch.Tensor
    new: int
    load: Any | None = None

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class StepLayer(DynamicLayer):
    """One layer of a step's `Cache` (`StepBatch`, `kvtier.engine.paged_step.PagedStep`): `update`
    hands the layer's new rows to the owner's `update_layer` and returns what it returns."""

    def __init__(self, owner: Any, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner.update_layer(self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return 0


class StepBatch(Cache):
    """The `Cache` of one step over `pieces` (decodes first: see the module docstring).

    `windows`: each layer's sliding window in tokens, None for full attention (every
    layer full when not given). `ids`: `[T]` int64, the step's new tokens in pack order
    (pieces in order, each piece's new tokens); needed when `spec` has an indexer buffer.
    """

    def __init__(
        self,
        spec: KVSpec,
        pool: DevicePool,
        pieces: Sequence[Piece],
        windows: Sequence[int | None] | None = None,
        ids: torch.Tensor | None = None,
    ) -> None:
        if not pieces:
            raise InvariantError("a step needs at least one piece")
        indexer = next((b for b in spec.buffers if b.kind is BufferKind.INDEXER), None)
        tokens = sum(p.new for p in pieces)
        if indexer is not None and (ids is None or tuple(ids.shape) != (tokens,)):
            got = None if ids is None else tuple(ids.shape)
            raise InvariantError(
                f"a step of {tokens} tokens with an indexer buffer needs [{tokens}] ids, got {got}"
            )
        windows = tuple(windows) if windows is not None else (None,) * spec.num_layers
        if len(windows) != spec.num_layers:
            raise InvariantError(f"{len(windows)} layer windows for a spec of {spec.num_layers} layers")
        super().__init__(layers=[StepLayer(self, i) for i in range(spec.num_layers)])
        self.spec, self.pool, self.pieces, self.windows = spec, pool, list(pieces), windows
        self._mla = spec.buffers[0].kind is BufferKind.MLA_LATENT
        dev = pool.device
        self.decodes = next((i for i, p in enumerate(self.pieces) if p.new != 1), len(self.pieces))
        lmax = max((p.length for p in self.pieces[: self.decodes]), default=0)
        self.lmax = lmax
        reads, writes, positions, last = [], [], [], []
        mask = torch.zeros(self.decodes, lmax, dtype=torch.bool)
        t = 0
        for i, p in enumerate(self.pieces):
            if p.new < 1 or p.new > p.length:
                raise InvariantError(f"piece {i}: {p.new} new tokens of a context of {p.length}")
            if i < self.decodes:
                pad = p.slots[:1].expand(lmax - p.length)
                reads.append(torch.cat([p.slots, pad]))
                mask[i, : p.length] = True
            else:
                reads.append(p.slots)
            writes.append(p.slots[p.length - p.new :])
            positions.append(torch.arange(p.length - p.new, p.length))
            t += p.new
            last.append(t - 1)
        self.tokens = t
        self.read_index = torch.cat(reads).to(dev)
        self.write_index = torch.cat(writes).to(dev)
        self.positions = torch.cat(positions).to(dev)  # `[T]` int64
        self.last = torch.tensor(last, device=dev)  # `[R]` int64: each piece's last token in the pack
        self._decode_mask = mask.view(self.decodes, 1, 1, lmax).to(dev)
        self._indexer = indexer
        self._indexer_layers = frozenset(indexer.layers) if indexer is not None else frozenset()
        if indexer is not None:  # `[T, 132]` uint8: the step's tokens' stand-in rows
            self._indexer_rows = token_rows(self.positions, ids.to(device=dev, dtype=torch.int64))
        self._masks: dict[tuple[int, torch.dtype, int | None], torch.Tensor] = {}
        self._waited = -1

    @contextmanager
    def active(self) -> Iterator[StepBatch]:
        """Make `attend` read this step's layout (for the current thread or task).

        SDPA's cuDNN backend is left out: it builds a plan per shape, and a step's shapes
        change every step (contexts grow by a token), bench/FINDINGS.md.
        """
        with stepping(self), sdpa_kernel(_BACKENDS):
            yield self

    def update_layer(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write the step's rows of `layer` and return every context: `[1, H, N, D]` each (N = reads)."""
        if layer > self._waited:
            for p in self.pieces:
                if p.load is not None:
                    p.load.wait_layer(layer)
            self._waited = layer
        idx, dst = self.write_index, self.read_index
        if layer in self._indexer_layers:
            rows = on_layer(self._indexer_rows, layer)
            self.pool.layer(self._indexer.name, layer).index_copy_(0, idx, rows)
        if self._mla:
            kv = self.pool.layer("kv", layer)  # [S, rank + rope]
            kv.index_copy_(0, idx, torch.cat([key_states[0, 0], value_states[0, 0]], dim=-1).to(kv.dtype))
            rows = kv[dst]
            rank = key_states.shape[-1]
            k = rows[:, :rank].unsqueeze(0).unsqueeze(0)
            v = rows[:, rank:].unsqueeze(0).unsqueeze(0)
        else:
            kp, vp = self.pool.layer("k", layer), self.pool.layer("v", layer)  # [S, H, D]
            kp.index_copy_(0, idx, key_states[0].transpose(0, 1).to(kp.dtype))
            vp.index_copy_(0, idx, value_states[0].transpose(0, 1).to(vp.dtype))
            k = kp[dst].permute(1, 0, 2).unsqueeze(0)
            v = vp[dst].permute(1, 0, 2).unsqueeze(0)
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def mask(self, i: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """Additive mask (0 seen, -inf not) of piece i, or of the decodes for `i = -1`.

        Decodes: `[B, 1, 1, Lmax]`, keys past each request's length hidden. A prefill piece:
        `[new, L - lo]` over its keys from `lo = first(i, window)`, its new tokens see every
        earlier token and themselves. A `window` hides, besides, the keys a window or more
        behind each query. (Additive masks in the queries' dtype: SDPA takes its fused
        kernels with them, bench/FINDINGS.md.)
        """
        key = (i, dtype, window)
        if key not in self._masks:
            if i < 0:
                seen = self._decode_mask
                if window is not None:
                    ends = torch.tensor([p.length for p in self.pieces[: self.decodes]], device=seen.device)
                    near = torch.arange(self.lmax, device=seen.device) > (ends - 1 - window).unsqueeze(1)
                    seen = seen & near.view(self.decodes, 1, 1, self.lmax)
            else:
                p = self.pieces[i]
                q = torch.arange(p.length - p.new, p.length).unsqueeze(1)
                k = torch.arange(self.first(i, window), p.length).unsqueeze(0)
                seen = k <= q
                if window is not None:
                    seen &= k > q - window
                seen = seen.to(self.pool.device)
            zero = torch.zeros((), dtype=dtype, device=seen.device)
            self._masks[key] = torch.where(seen, zero, torch.finfo(dtype).min)
        return self._masks[key]

    def first(self, i: int, window: int | None) -> int:
        """The first context position any new token of prefill piece i sees under `window`."""
        p = self.pieces[i]
        return 0 if window is None else max(0, p.length - p.new - window + 1)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: int,
        scale: float | None,
        softcap: float | None = None,
        module: Any = None,
    ):
        """`[1, T, Hq, Dv]`: each piece's queries over its own context; see the module docstring.

        `query`: `[1, Hq, T, Dq]`; `key` / `value`: `[1, Hkv, N, D]` in `read_index` order.
        (`module`, the model's attention, is the paged step's concern.)
        """
        if not 0 <= layer < len(self.windows):
            raise InvariantError(f"attention of layer {layer} in a step of {len(self.windows)} layers")
        window = self.windows[layer]
        hq, hkv = query.shape[1], key.shape[1]
        group = hq // hkv
        outs = []
        b, lmax = self.decodes, self.lmax
        if b:
            # One token per request: its `group` query heads of a KV head act as `group`
            # query rows over that head's keys (same mask row), so no KV head is repeated.
            q = query[0, :, :b].view(hkv, group, b, -1).permute(2, 0, 1, 3).contiguous()  # [B, Hkv, G, D]
            k = key[0, :, : b * lmax].unflatten(1, (b, lmax)).transpose(0, 1)  # [B, Hkv, Lmax, D]
            v = value[0, :, : b * lmax].unflatten(1, (b, lmax)).transpose(0, 1)
            o = _attention(q, k, v, self.mask(-1, query.dtype, window), scale, softcap)
            outs.append(o.reshape(b, hq, -1))  # [B, Hq, Dv]: head h = kv head h // G, as transformers
        t, n = b, b * lmax
        for i in range(b, len(self.pieces)):
            p = self.pieces[i]
            lo = self.first(i, window)  # keys before it are outside every new token's window
            q = query[:, :, t : t + p.new]
            k, v = key[:, :, n + lo : n + p.length], value[:, :, n + lo : n + p.length]
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            if p.new == p.length and window is None and softcap is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                o = _attention(q, k, v, self.mask(i, q.dtype, window), scale, softcap)
            outs.append(o[0].transpose(0, 1))  # [new, Hq, Dv]
            t, n = t + p.new, n + p.length
        return torch.cat(outs).unsqueeze(0), None


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """`[..., Q, Dv]`: SDPA, or with `softcap` transformers' eager math (SDPA cannot soft-cap).

    `q`: `[..., Q, D]`; `k` / `v`: `[..., K, D]`; `mask`: additive, broadcast to `[..., Q, K]`.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs):
    """The `"kvtier"` attention implementation: the active step's layout, else transformers' own."""
    if kwargs.get("s_aux") is not None:
        raise InvariantError(f"{type(module).__name__}: attention sinks (s_aux) are not supported by kvtier")
    step = _active.get()
    softcap = _softcap(module, kwargs)
    if step is None:
        if softcap is None:
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, **kwargs)
        return _eager_outside_a_step(query, key, value, mask, kwargs.get("scaling"), softcap)
    causal = kwargs.get("is_causal")
    if (causal if causal is not None else getattr(module, "is_causal", True)) is False:
        raise InvariantError(f"{type(module).__name__}: a step attends causally only")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise InvariantError(f"{type(module).__name__} has no layer_idx; kvtier's step needs it")
    return step.attend(query, key, value, layer, kwargs.get("scaling"), softcap, module)


def _softcap(module: Any, kwargs: dict) -> float | None:
    """The call's attention soft cap: its `softcap` argument, else the module's or its config's
    `attn_logit_softcapping` (transformers versions differ in which they pass)."""
    cap = kwargs.get("softcap")
    if cap is None:
        cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    return cap


def _eager_outside_a_step(query, key, value, mask: torch.Tensor | None, scale: float | None, softcap: float):
    """`[B, Q, Hq, Dv]`, None: soft-capped attention with transformers' mask (bool, or None: causal).

    `query`: `[B, Hq, Q, D]`; `key` / `value`: `[B, Hkv, K, D]`.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    q_len = query.shape[2]
    if mask is None and q_len > 1:  # transformers skipped a plain causal mask: SDPA's `is_causal`
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        mask = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
    if mask is None:
        additive = torch.zeros((), dtype=query.dtype, device=query.device)
    elif mask.dtype == torch.bool:
        additive = torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    else:
        additive = mask.to(query.dtype)
    out = _attention(query, key, value, additive, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def _mask(*args, **kwargs):
    """The `"kvtier"` mask implementation: none in a step (`attend` makes its own), else SDPA's."""
    return None if _active.get() is not None else sdpa_mask(*args, **kwargs)


if AttentionInterface is not None:
    AttentionInterface.register(ATTENTION, attend)
    AttentionMaskInterface.register(ATTENTION, _mask)


@contextmanager
def kvtier_attention(config: Any) -> Iterator[None]:
    """Switch a model's config (and its text part) to `"kvtier"` attention for a forward."""
    configs = {id(config): config}
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    configs[id(text)] = text
    before = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTENTION
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = before[k]
