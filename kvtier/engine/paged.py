"""Attention over the device pool in place: Triton kernels that read K/V through slot tables.

A request's context is the list of its device slots (`table[r, :len[r]]`, in order); the
kernels read each key and value row where the pool holds it, so no context is gathered into a
transient buffer. Three kernels, one job each:

- `write_rows`: the step's new rows into the pool (`dst[slot[t]] = src[t]`); a slot below 0
  writes nothing (the padding rows of a CUDA graph's bucket).
- `decode`: one query token per request over its whole context (`[lo, len)`, `lo` the first
  key its window sees). A program takes one KV head of one request and the `G` query heads of
  that head (GQA: the group shares each key load), over one of `splits` equal parts of the
  context; `splits > 1` writes partial results and their log-sum-exp, merged by a reduce.
- `prefill`: the new tokens of prefill pieces, each over its own table: query `m` of a piece of
  `new` tokens and context `len` sits at position `len - new + m` and sees keys `<=` it (and,
  with a window, keys `> position - window`).

Scores are `q . k * scale`, soft-capped (`cap * tanh(s / cap)`) where a cap is given, then a
softmax in fp32 (keys a query cannot see take no weight; a query that sees none gets zeros).

MLA (absorbed): K is two parts of one row, `k1` (the latent, also V) and `k2` (the rotary
part), strided views of the pool's "kv" buffer (`KVView.mla`); the query brings both parts
(`q1` latent, `q2` rotary). Standard attention: `k1 = k`, no `k2`, `v` its own buffer.

Tensors (last dim contiguous): queries `q1` `[T, Hq, D1]`, `q2` `[T, Hq, D2]`; pool views
`k1` `[S, Hkv, D1]`, `k2` `[S, Hkv, D2]`, `v` `[S, Hkv, DV]`; tables `[R, W]` int64 (W >= every
`len`), lengths / new counts / first token of each piece `[R]` int64; `out` `[T, Hq, DV]`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from kvtier import jit
from kvtier.errors import InvariantError
from kvtier.jit import ModeJit, next_power_of_2, tl
from kvtier.jit import runs_on as runs_on  # the paged kernels run where Triton does


@dataclass(frozen=True)
class KVView:
    """One layer's K and V where the pool holds them (see the module docstring for shapes)."""

    k1: torch.Tensor
    k2: torch.Tensor | None
    v: torch.Tensor

    @classmethod
    def mha(cls, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Separate `[S, Hkv, D]` K and V buffers."""
        return cls(k, None, v)

    @classmethod
    def mla(cls, kv: torch.Tensor, rank: int) -> KVView:
        """One `[S, rank + rope]` row per token: `k1 = v = row[:rank]`, `k2 = row[rank:]`."""
        return cls(kv[:, None, :rank], kv[:, None, rank:], kv[:, None, :rank])


def _write_rows_kernel(
    src_ptr, dst_ptr, slot_ptr, H, D, s_t, s_h, d_s, d_h, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D) & (h * 0 + slot >= 0)
    x = tl.load(src_ptr + t * s_t + h * s_h + d, mask=mask)
    tl.store(dst_ptr + slot * d_s + h * d_h + d, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """`a @ b` with fp32 accumulation; `UPCAST`: operands in fp32 (the interpreter's bf16 dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


def _attend_block(
    q1, q2, m_i, l_i, acc, seen, slots, kvh, k1_ptr, k2_ptr, v_ptr, sk1_s, sk1_h, sk2_s, sk2_h, sv_s, sv_h,
    d1, d2, dv, D1, D2, DV, scale, softcap, HAS_D2: tl.constexpr, SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """One block of `N` keys (pool rows `slots` of KV head `kvh`) into the online softmax of `M` queries.

    `seen`: `[M, N]` which keys each query sees; returns the updated `(m_i, l_i, acc)`.
    """
    nmask = slots >= 0
    k1 = tl.load(k1_ptr + slots[:, None] * sk1_s + kvh * sk1_h + d1[None, :], mask=nmask[:, None] & (d1 < D1))
    s = _dot_jit(q1, tl.trans(k1), PREC, UPCAST)
    if HAS_D2:
        k2 = tl.load(
            k2_ptr + slots[:, None] * sk2_s + kvh * sk2_h + d2[None, :], mask=nmask[:, None] & (d2 < D2)
        )
        s += _dot_jit(q2, tl.trans(k2), PREC, UPCAST)
    s = s * scale
    if SOFTCAP:  # cap * tanh(s / cap), tanh from exp (one formula on the GPU and the interpreter)
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no NaN from -inf - -inf
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_ptr + slots[:, None] * sv_s + kvh * sv_h + dv[None, :], mask=nmask[:, None] & (dv < DV))
    acc = acc * alpha[:, None] + _dot_jit(p.to(v.dtype), v, PREC, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


def _decode_kernel(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, table_ptr, lens_ptr, o_ptr, lse_ptr,
    sq1_t, sq1_h, sq2_t, sq2_h, sk1_s, sk1_h, sk2_s, sk2_h, sv_s, sv_h,
    st_r, so_t, so_h, so_s, sl_t, sl_h,
    scale, softcap, window, G, D1, D2, DV, splits,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_D2: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    DIRECT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    blocks = tl.cdiv(G, BLOCK_G)
    kvh = hb // blocks
    g = (hb % blocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < G
    heads = kvh * G + g
    length = tl.load(lens_ptr + b)
    lo = length * 0
    if WINDOW:
        lo = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, splits), BLOCK_N) * BLOCK_N
    start = lo + sp * chunk
    end = tl.minimum(start + chunk, length)
    d1 = tl.arange(0, BLOCK_D1)
    d2 = tl.arange(0, BLOCK_D2)
    dv = tl.arange(0, BLOCK_DV)
    q1 = tl.load(q1_ptr + b * sq1_t + heads[:, None] * sq1_h + d1[None, :], mask=gmask[:, None] & (d1 < D1))
    q2 = q1
    if HAS_D2:
        q2 = tl.load(
            q2_ptr + b * sq2_t + heads[:, None] * sq2_h + d2[None, :], mask=gmask[:, None] & (d2 < D2)
        )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        slots = tl.load(table_ptr + b * st_r + n, mask=nmask, other=-1).to(tl.int64)
        m_i, l_i, acc = _attend_block_jit(
            q1, q2, m_i, l_i, acc, nmask[None, :], slots, kvh, k1_ptr, k2_ptr, v_ptr, sk1_s, sk1_h,
            sk2_s, sk2_h, sv_s, sv_h, d1, d2, dv, D1, D2, DV, scale, softcap, HAS_D2, SOFTCAP, PREC, UPCAST,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = gmask[:, None] & (dv[None, :] < DV)
    if DIRECT:
        dst = o_ptr + b * so_t + heads[:, None] * so_h + dv[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(o_ptr + b * so_t + heads[:, None] * so_h + sp * so_s + dv[None, :], out, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * sl_t + heads * sl_h + sp, lse, mask=gmask)


def _reduce_kernel(
    o_ptr, lse_ptr, out_ptr, so_t, so_h, so_s, sl_t, sl_h, sout_t, sout_h, DV, splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    smask = s < splits
    lse = tl.load(lse_ptr + b * sl_t + h * sl_h + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(
        o_ptr + b * so_t + h * so_h + s[:, None] * so_s + dv[None, :], mask=smask[:, None] & (dv < DV)
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * sout_t + h * sout_h + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _prefill_kernel(
    q1_ptr, q2_ptr, k1_ptr, k2_ptr, v_ptr, table_ptr, lens_ptr, news_ptr, starts_ptr, o_ptr,
    sq1_t, sq1_h, sq2_t, sq2_h, sk1_s, sk1_h, sk2_s, sk2_h, sv_s, sv_h, st_r, so_t, so_h,
    scale, softcap, window, G, D1, D2, DV,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_D2: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    mb = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    new = tl.load(news_ptr + r)
    if mb * BLOCK_M < new:
        length = tl.load(lens_ptr + r)
        first = tl.load(starts_ptr + r)
        kvh = h // G
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < new
        pos = length - new + m  # each query's position in its context
        d1 = tl.arange(0, BLOCK_D1)
        d2 = tl.arange(0, BLOCK_D2)
        dv = tl.arange(0, BLOCK_DV)
        rows = (first + m).to(tl.int64)
        q1 = tl.load(
            q1_ptr + rows[:, None] * sq1_t + h * sq1_h + d1[None, :], mask=mmask[:, None] & (d1 < D1)
        )
        q2 = q1
        if HAS_D2:
            q2 = tl.load(
                q2_ptr + rows[:, None] * sq2_t + h * sq2_h + d2[None, :], mask=mmask[:, None] & (d2 < D2)
            )
        hi = tl.minimum(length, length - new + mb * BLOCK_M + BLOCK_M)
        lo = hi * 0
        if WINDOW:
            lo = tl.maximum(length - new + mb * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            slots = tl.load(table_ptr + r * st_r + n, mask=nmask, other=-1).to(tl.int64)
            seen = nmask[None, :] & (n[None, :] <= pos[:, None])
            if WINDOW:
                seen = seen & (n[None, :] > pos[:, None] - window)
            m_i, l_i, acc = _attend_block_jit(
                q1, q2, m_i, l_i, acc, seen, slots, kvh, k1_ptr, k2_ptr, v_ptr, sk1_s, sk1_h, sk2_s, sk2_h,
                sv_s, sv_h, d1, d2, dv, D1, D2, DV, scale, softcap, HAS_D2, SOFTCAP, PREC, UPCAST,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = o_ptr + rows[:, None] * so_t + h * so_h + dv[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & (dv[None, :] < DV))


# Bound by the `ModeJit`s: the Triton-wrapped helpers the kernels call.
_dot_jit: Any = None
_attend_block_jit: Any = None
_write_rows = ModeJit(_write_rows_kernel)
_decode = ModeJit(_decode_kernel, _dot, _attend_block)
_reduce = ModeJit(_reduce_kernel)
_prefill = ModeJit(_prefill_kernel, _dot, _attend_block)


def _block(n: int) -> int:
    """A block dim of at least `n` (a power of two, 16 at least: `tl.dot`'s smallest)."""
    return max(16, next_power_of_2(n))


def _device(t: torch.Tensor) -> Any:  # the launch's device (the interpreter has none)
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def write_rows(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """`dst[slots[t]] = src[t]` for every `slots[t] >= 0`, cast to `dst`'s dtype.

    `dst`: `[S, H, D]` (rows strided, heads and dims as `[H, D]` with the last dim contiguous);
    `src`: `[T, H, D]` (any strides, last dim contiguous); `slots`: `[T]` int64.
    """
    t, h, d = src.shape
    if dst.shape[1:] != (h, d) or src.stride(-1) != 1 or dst.stride(-1) != 1 or slots.shape != (t,):
        raise InvariantError(
            f"write_rows: src {tuple(src.shape)}, dst {tuple(dst.shape)}, slots {slots.shape}"
        )
    with _device(dst):
        _write_rows()[(t,)](
            src, dst, slots, h, d, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            BLOCK_H=next_power_of_2(h), BLOCK_D=next_power_of_2(d),
        )  # fmt: skip


def _common(q1: torch.Tensor, q2: torch.Tensor | None, kv: KVView, out: torch.Tensor) -> tuple:
    """The launch arguments shared by both attention kernels, checked."""
    hq, d1 = q1.shape[1:]
    hkv, dv = kv.v.shape[1:]
    d2 = 0 if kv.k2 is None else kv.k2.shape[2]
    if (
        hq % hkv
        or kv.k1.shape[1:] != (hkv, d1)
        or (q2 is None) != (kv.k2 is None)
        or (q2 is not None and q2.shape[1:] != (hq, d2))
        or out.shape[1:] != (hq, dv)
        or any(x.stride(-1) != 1 for x in (q1, kv.k1, kv.v, out, *(t for t in (q2, kv.k2) if t is not None)))
    ):
        raise InvariantError(
            f"paged attention: q {tuple(q1.shape)}, k {tuple(kv.k1.shape)}, v {tuple(kv.v.shape)}, "
            f"out {tuple(out.shape)} (last dims contiguous)"
        )
    q2_, k2_ = (q1, kv.k1) if q2 is None else (q2, kv.k2)
    ptrs = (q1, q2_, kv.k1, k2_, kv.v)
    strides = (
        *q1.stride()[:2],
        *q2_.stride()[:2],
        *kv.k1.stride()[:2],
        *k2_.stride()[:2],
        *kv.v.stride()[:2],
    )
    blocks = dict(
        BLOCK_D1=_block(d1), BLOCK_D2=_block(d2), BLOCK_DV=_block(dv), HAS_D2=q2 is not None,
        PREC="ieee" if q1.dtype == torch.float32 else "tf32",
        UPCAST=jit.interpreting() and q1.dtype != torch.float32,
    )  # fmt: skip
    return ptrs, strides, blocks, hq // hkv, hkv, d1, d2, dv


def decode_block(d: int) -> int:  # keys per block of the decode kernel: fewer for wide rows
    return 64 if d <= 128 else 32 if d <= 256 else 16


def decode_splits(programs: int, max_len: int, block_n: int, sms: int) -> int:
    """Parts each context is cut into: enough programs for two per SM, each part two blocks or more."""
    want = -(-2 * sms // max(programs, 1))
    return max(1, min(want, -(-max_len // (2 * block_n)), 64))


def decode(
    q1: torch.Tensor,
    q2: torch.Tensor | None,
    kv: KVView,
    table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    splits: int = 1,
) -> None:
    """Write `out[b]` (`[B, Hq, DV]`): query `q1[b]` (and `q2[b]`) over request b's context.

    `table`: `[B, W]` int64 slots; `lens`: `[B]` int64 (0: `out[b]` is zeros). `splits`: parts
    of each context (`decode_splits`), merged by a second kernel when more than one.
    """
    ptrs, strides, blocks, group, hkv, d1, d2, dv = _common(q1, q2, kv, out)
    b = lens.shape[0]
    if b == 0:
        return
    block_g = min(64, _block(group))
    grid = (b, hkv * -(-group // block_g), splits)
    direct = splits == 1
    if direct:
        part, lse = out, out
        o_strides = (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        part = torch.empty(b, out.shape[1], splits, dv, dtype=torch.float32, device=out.device)
        lse = torch.empty(b, out.shape[1], splits, dtype=torch.float32, device=out.device)
        o_strides = (*part.stride()[:3], *lse.stride()[:2])
    with _device(out):
        _decode()[grid](
            *ptrs, table, lens, part, lse, *strides, table.stride(0), *o_strides,
            scale, softcap or 0.0, window or 0, group, d1, d2, dv, splits,
            BLOCK_G=block_g, BLOCK_N=decode_block(max(d1, dv)), SOFTCAP=softcap is not None,
            WINDOW=window is not None, DIRECT=direct, **blocks,
        )  # fmt: skip
        if not direct:
            _reduce()[(b, out.shape[1])](
                part, lse, out, *part.stride()[:3], *lse.stride()[:2], *out.stride()[:2], dv, splits,
                BLOCK_S=next_power_of_2(splits), BLOCK_DV=blocks["BLOCK_DV"],
            )  # fmt: skip


def prefill(
    q1: torch.Tensor,
    q2: torch.Tensor | None,
    kv: KVView,
    table: torch.Tensor,
    lens: torch.Tensor,
    news: torch.Tensor,
    starts: torch.Tensor,
    out: torch.Tensor,
    max_new: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Write `out[starts[r] : + news[r]]`: piece r's queries (rows of `q1` / `q2` from `starts[r]`)
    over its context, causal from position `lens[r] - news[r]`.

    `table`: `[P, W]` int64; `lens`, `news`, `starts`: `[P]` int64; `max_new`: the largest of `news`.
    """
    ptrs, strides, blocks, group, _, d1, d2, dv = _common(q1, q2, kv, out)
    if lens.shape[0] == 0:
        return
    wide = max(d1 + d2, dv)
    block_m, block_n = (64, 64) if wide <= 128 else (32, 32) if wide <= 256 else (16, 16)
    grid = (-(-max_new // block_m), lens.shape[0], out.shape[1])
    with _device(out):
        _prefill()[grid](
            *ptrs, table, lens, news, starts, out, *strides, table.stride(0), out.stride(0), out.stride(1),
            scale, softcap or 0.0, window or 0, group, d1, d2, dv,
            BLOCK_M=block_m, BLOCK_N=block_n, SOFTCAP=softcap is not None, WINDOW=window is not None,
            num_warps=4, **blocks,
        )  # fmt: skip
