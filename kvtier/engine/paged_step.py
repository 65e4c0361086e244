"""One step's forward that reads K/V where the device pool holds them (the GPU path).

`PagedStep` is the transformers `Cache` of a step as `kvtier.engine.batch.StepBatch` is, with
the same packing (`[1, T]`, decodes first, then prefill pieces) and the same math, but no
context is gathered: at layer i `update_layer` writes the new rows to their slots
(`kvtier.engine.paged.write_rows`) and hands the model back only those rows, and `attend`
runs the paged kernels over each request's slot table: the decodes in one `decode` launch
(each request's context cut into `splits` parts), every prefill piece in one `prefill` launch.

MLA runs absorbed: the query's non-rotary part goes through the model's `kv_b_proj` key half
into the latent space (`[T, H, rank]`), the kernel attends over the pool's latent rows (the
latent is the value), and the latent output goes through the value half of `kv_b_proj`. The
model's own expansion of the step's new rows (`expand_kv`) still runs and is not read.

Nothing in `update_layer` or `attend` reads the device from the host, so a decode-only step
can be captured in a CUDA graph (`kvtier.engine.graphs`): the step's metadata (`StepLayout`)
is then the graph's static buffers, refilled before each replay. Eager steps stage theirs in
one pinned copy (`stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.engine import paged
from kvtier.engine.batch import Cache, StepLayer, stepping
from kvtier.engine.hostio import host_buffer, to_device
from kvtier.engine.indexer import on_layer, token_rows
from kvtier.engine.paged import KVView
from kvtier.errors import InvariantError
from kvtier.pool import DevicePool
from kvtier.spec import BufferKind, KVSpec


@dataclass(frozen=True)
class StepLayout:
    """A step's metadata on the device. All int64.

    `ids`, `positions`, `write`: `[T]` the packed tokens, their positions and their slots (-1:
    written nowhere, a graph's padding); `last`: `[R]` each piece's last token in the pack;
    `dec_table` `[B, Wd]`, `dec_lens` `[B]`: the decodes' slot tables and context lengths;
    `pf_table` `[P, Wp]`, `pf_lens`, `pf_news`, `pf_starts` `[P]`: the prefill pieces' tables,
    context lengths, new tokens and first token in the pack; `max_new`: the most new tokens
    of a piece.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    last: torch.Tensor
    dec_table: torch.Tensor
    dec_lens: torch.Tensor
    pf_table: torch.Tensor
    pf_lens: torch.Tensor
    pf_news: torch.Tensor
    pf_starts: torch.Tensor
    max_new: int

    @property
    def decodes(self) -> int:
        return int(self.dec_lens.shape[0])


@dataclass(frozen=True)
class HostLayout:
    """`StepLayout`'s arrays on the host (numpy int64), built from the step's pieces."""

    arrays: dict[str, np.ndarray]
    max_new: int

    @classmethod
    def of(cls, pieces: Sequence[tuple[np.ndarray, int]], ids: np.ndarray) -> HostLayout:
        """`pieces`: `(slots [L] int64, new)` per request, one-token pieces (decodes) first.

        Per piece only its length, its count and its table row are read in Python; the
        positions and write slots are whole-array operations over the padded tables.
        """
        r = len(pieces)
        lens = np.array([len(s) for s, _ in pieces], np.int64)
        news = np.array([n for _, n in pieces], np.int64)
        if ((news < 1) | (news > lens)).any():
            raise InvariantError(f"a step's pieces: {news.tolist()} new of contexts {lens.tolist()}")
        ids = np.asarray(ids, np.int64)
        if int(news.sum()) == r:  # every piece one token: a decode-only step
            table = _table([s for s, _ in pieces], lens)
            positions = lens - 1
            none = np.zeros(0, np.int64)
            arrays = {
                "ids": ids,
                "positions": positions,
                "write": table[np.arange(r), positions],
                "last": np.arange(r, dtype=np.int64),
                "dec_table": table,
                "dec_lens": lens,
                "pf_table": np.zeros((0, 0), np.int64),
                "pf_lens": none,
                "pf_news": none,
                "pf_starts": none,
            }
            return cls(arrays, 0)
        b = int(np.argmax(news != 1))
        ends = np.cumsum(news)
        starts = ends - news  # each piece's first token in the pack
        # token t of piece i sits at position lens[i] - news[i] + (t - starts[i])
        positions = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(lens - news - starts, news)
        dec_table = _table([s for s, _ in pieces[:b]], lens[:b])
        pf_table = _table([s for s, _ in pieces[b:]], lens[b:])
        pf_rows = np.repeat(np.arange(r - b), news[b:])
        write = np.concatenate([dec_table[np.arange(b), lens[:b] - 1], pf_table[pf_rows, positions[b:]]])
        arrays = {
            "ids": ids,
            "positions": positions,
            "write": write,
            "last": ends - 1,
            "dec_table": dec_table,
            "dec_lens": lens[:b],
            "pf_table": pf_table,
            "pf_lens": lens[b:],
            "pf_news": news[b:],
            "pf_starts": starts[b:],
        }
        return cls(arrays, int(news[b:].max()))

    @property
    def decode_only(self) -> bool:
        return not len(self.arrays["pf_lens"])

    def stage(self, device: torch.device) -> StepLayout:
        """The arrays on `device` through one pinned buffer and one copy that the host does not wait for."""
        staged = host_buffer(sum(a.size for a in self.arrays.values()), device)
        flat, at = staged.numpy(), 0
        for a in self.arrays.values():
            flat[at : at + a.size] = a.reshape(-1)
            at += a.size
        buf = to_device(staged, device)
        views, at = {}, 0
        for name, a in self.arrays.items():
            views[name] = buf[at : at + a.size].view(a.shape)
            at += a.size
        return StepLayout(**views, max_new=self.max_new)


def _table(rows: list[np.ndarray], lens: np.ndarray) -> np.ndarray:
    """`[R, max len]` int64: each row's slots (`lens` `[R]` their lengths), padded with -1."""
    out = np.full((len(rows), int(lens.max(initial=0))), -1, np.int64)
    for i, row in enumerate(rows):  # a row's copy is one memcpy (a boolean-mask fill is far slower)
        out[i, : len(row)] = row
    return out


class PagedStep(Cache):
    """The `Cache` of one step whose attention reads the pool in place; see the module docstring.

    `layout`: the step's metadata on the pool's device; `windows`: each layer's sliding window
    (None: full); `loads`: the pending loads whose `wait_layer(i)` must pass before layer i;
    `splits`: parts of each decode's context (`kvtier.engine.paged.decode_splits`).
    """

    def __init__(
        self,
        spec: KVSpec,
        pool: DevicePool,
        layout: StepLayout,
        windows: Sequence[int | None],
        loads: Sequence[Any] = (),
        splits: int = 1,
    ) -> None:
        if len(windows) != spec.num_layers:
            raise InvariantError(f"{len(windows)} layer windows for a spec of {spec.num_layers} layers")
        super().__init__(layers=[StepLayer(self, i) for i in range(spec.num_layers)])
        self.spec, self.pool, self.layout, self.windows = spec, pool, layout, tuple(windows)
        self.loads, self.splits = list(loads), splits
        self._mla = spec.buffers[0].kind is BufferKind.MLA_LATENT
        self._indexer = next((b for b in spec.buffers if b.kind is BufferKind.INDEXER), None)
        self._indexer_rows: torch.Tensor | None = None
        self._waited = -1

    def active(self):
        """Make `kvtier.engine.batch.attend` call this step's `attend` (current thread or task)."""
        return stepping(self)

    def update_layer(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write the step's rows of `layer` to their slots; return the rows as given."""
        if layer > self._waited:
            for load in self.loads:
                load.wait_layer(layer)
            self._waited = layer
        write = self.layout.write
        if self._indexer is not None and layer in self._indexer.layers:
            if layer == self._indexer.layers[0]:  # `[T, 132]` uint8, remade by every forward and replay
                self._indexer_rows = token_rows(self.layout.positions, self.layout.ids)
            dst = self.pool.layer(self._indexer.name, layer)
            paged.write_rows(dst[:, None], on_layer(self._indexer_rows, layer)[:, None], write)
        if self._mla:
            kv = self.pool.layer("kv", layer)  # [S, rank + rope]
            rank = key_states.shape[-1]
            paged.write_rows(kv[:, None, :rank], _rows(key_states), write)
            paged.write_rows(kv[:, None, rank:], _rows(value_states), write)
        else:
            paged.write_rows(self.pool.layer("k", layer), _rows(key_states), write)
            paged.write_rows(self.pool.layer("v", layer), _rows(value_states), write)
        return key_states, value_states

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
        """`[1, T, Hq, Dv]`: each piece's queries over its context in the pool (`key` / `value`,
        the model's view of this step's new rows, are not read).

        `query`: `[1, Hq, T, Dq]` (for MLA the model's `[q_nope, q_rope]`).
        """
        if not 0 <= layer < len(self.windows):
            raise InvariantError(f"attention of layer {layer} in a step of {len(self.windows)} layers")
        q = query[0].transpose(0, 1)  # [T, Hq, Dq]
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        if self._mla:
            q1, q2, kv, w_uv = self._absorbed(q, layer, module)
        else:
            q1, q2 = _contiguous_last(q), None
            kv = KVView.mha(self.pool.layer("k", layer), self.pool.layer("v", layer))
        out = torch.empty(q.shape[0], q.shape[1], kv.v.shape[2], dtype=q.dtype, device=q.device)
        lay, window = self.layout, self.windows[layer]
        if lay.decodes:
            paged.decode(q1, q2, kv, lay.dec_table, lay.dec_lens, out, scale, softcap, window, self.splits)
        if lay.pf_lens.shape[0]:
            paged.prefill(
                q1, q2, kv, lay.pf_table, lay.pf_lens, lay.pf_news, lay.pf_starts, out, lay.max_new,
                scale, softcap, window,
            )  # fmt: skip
        if self._mla:  # the latent output through each head's value projection: [H, T, rank] @ [H, rank, Dv]
            out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return out.unsqueeze(0), None

    def _absorbed(self, q: torch.Tensor, layer: int, module: Any) -> tuple:
        """MLA's latent query `[T, H, rank]` (through `kv_b_proj`'s key half `[H, nope, rank]`),
        rotary query `[T, H, rope]`, the pool view, and `kv_b_proj`'s value half `[H, Dv, rank]`."""
        try:
            nope, dv = module.qk_nope_head_dim, module.v_head_dim
            weight = module.kv_b_proj.weight
        except AttributeError as e:
            raise InvariantError(f"{type(module).__name__}: MLA without kv_b_proj / head dims: {e}") from e
        kv_buf = self.pool.layer("kv", layer)
        rank = weight.shape[1]
        w = weight.view(q.shape[1], nope + dv, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        return _contiguous_last(q_lat), _contiguous_last(q[..., nope:]), KVView.mla(kv_buf, rank), w_uv


def _rows(states: torch.Tensor) -> torch.Tensor:
    """`[T, H, D]` view of a model's `[1, H, T, D]` K or V states (last dim made contiguous)."""
    return _contiguous_last(states[0].transpose(0, 1))


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
