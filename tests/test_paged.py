"""The paged attention kernels (`kvtier.engine.paged`) against plain attention over gathered rows.

On a machine without CUDA the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set
here before Triton is imported), at small sizes; on a GPU machine the compiled kernels run. The
reference gathers each request's rows from the pool by its table and computes the softmax in
float64; pool slots outside every table hold NaN, so a kernel that reads one fails.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from kvtier.engine import paged
from kvtier.engine.paged import KVView

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not paged.runs_on(DEVICE):  # pragma: no cover - depends on the environment
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SLOTS = 96


def pool_and_tables(gen, lens, shape, dtype):
    """A NaN-poisoned `[SLOTS, *shape]` pool with random rows at each request's (shuffled, distinct) slots."""
    pool = torch.full((SLOTS, *shape), float("nan"), dtype=dtype)
    order = torch.randperm(SLOTS, generator=gen)
    tables, used = [], 0
    width = max(lens) + 3  # past every length: the kernel must not read there
    for n in lens:
        row = torch.full((width,), SLOTS + 1000, dtype=torch.int64)  # out of range: a read would fault
        row[:n] = order[used : used + n]
        used += n
        tables.append(row)
    rows = torch.cat([t[:n] for t, n in zip(tables, lens, strict=True)])
    pool[rows] = torch.randn(len(rows), *shape, generator=gen).to(dtype)
    return pool, torch.stack(tables)


def reference(q, k, v, pos, scale, softcap, window):
    """`[Hq, DV]` float64: one query at `pos` over keys `[L, Hkv, Dk]` (causal, window, cap)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q, k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n = torch.arange(k.shape[0])
    seen = n <= pos
    if window is not None:
        seen &= n > pos - window
    if not seen.any():
        return torch.zeros(q.shape[0], v.shape[2], dtype=torch.float64)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hn,nhd->hd", p, v)


def layouts(kind, hkv, group, d, dtype, gen, lens):
    """`(q_dims, kv view, reference keys and values of request r)` for a standard or an MLA layout."""
    if kind == "mha":
        kp, table = pool_and_tables(gen, lens, (hkv, d), dtype)
        vp = torch.full_like(kp, float("nan"))
        vp[table[table < SLOTS]] = torch.randn(int((table < SLOTS).sum()), hkv, d, generator=gen).to(dtype)
        view = KVView.mha(kp.to(DEVICE), vp.to(DEVICE))

        def kv_of(r):
            rows = table[r, : lens[r]]
            return kp[rows], vp[rows]

        return (d, None), view, table, kv_of
    rank, rope = d, 8  # MLA: one latent row of rank + rope, the latent also the value
    kvp, table = pool_and_tables(gen, lens, (rank + rope,), dtype)
    view = KVView.mla(kvp.to(DEVICE), rank)

    def kv_of(r):
        rows = kvp[table[r, : lens[r]]]
        return rows[:, None], rows[:, None, :rank]

    return (rank, rope), view, table, kv_of


CASES = [  # kind, hkv, group, d, window, softcap, lens
    ("mha", 2, 1, 16, None, None, [1, 5, 33]),
    ("mha", 2, 4, 16, None, None, [70, 1, 16]),
    ("mha", 1, 4, 24, 7, None, [40, 3]),
    ("mha", 2, 2, 16, None, 0.5, [19, 64]),
    ("mha", 2, 4, 16, 5, 2.0, [1, 50]),
    ("mla", 1, 4, 32, None, None, [1, 45, 17]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_attention_over_gathered_rows(case, splits, dtype) -> None:
    kind, hkv, group, d, window, softcap, lens = case
    gen = torch.Generator().manual_seed(hash((kind, hkv, group, window, len(lens))) % 2**31)
    (d1, d2), view, table, kv_of = layouts(kind, hkv, group, d, dtype, gen, lens)
    hq, dv, b = hkv * group, view.v.shape[2], len(lens)
    q = torch.randn(b, hq, d1 + (d2 or 0), generator=gen).to(dtype)
    scale = (d1 + (d2 or 0)) ** -0.5
    out = torch.full((b, hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    qd = q.to(DEVICE)
    q1, q2 = (qd, None) if d2 is None else (qd[..., :d1], qd[..., d1:])
    lens_t = torch.tensor(lens, device=DEVICE)
    paged.decode(q1, q2, view, table.to(DEVICE), lens_t, out, scale, softcap, window, splits)
    for r, n in enumerate(lens):
        k, v = kv_of(r)
        want = reference(q[r], k, v, n - 1, scale, softcap, window)
        torch.testing.assert_close(out[r].cpu().double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[1:])
def test_prefill_pieces_match_causal_attention_with_their_offsets(case, dtype) -> None:
    kind, hkv, group, d, window, softcap, lens = case
    gen = torch.Generator().manual_seed(7)
    news = [max(1, n // 2) if i % 2 else n for i, n in enumerate(lens)]  # a whole prompt, a later piece
    (d1, d2), view, table, kv_of = layouts(kind, hkv, group, d, dtype, gen, lens)
    hq, dv, t = hkv * group, view.v.shape[2], sum(news)
    q = torch.randn(t, hq, d1 + (d2 or 0), generator=gen).to(dtype)
    scale = 0.3
    out = torch.full((t, hq, dv), float("nan"), dtype=dtype, device=DEVICE)
    qd = q.to(DEVICE)
    q1, q2 = (qd, None) if d2 is None else (qd[..., :d1], qd[..., d1:])
    starts = torch.tensor([0, *torch.tensor(news).cumsum(0)[:-1].tolist()])
    args = [torch.tensor(x, device=DEVICE) for x in (lens, news)]
    paged.prefill(
        q1, q2, view, table.to(DEVICE), *args, starts.to(DEVICE), out, max(news), scale, softcap, window
    )
    for r, (n, new) in enumerate(zip(lens, news, strict=True)):
        k, v = kv_of(r)
        for m in range(new):
            want = reference(q[starts[r] + m], k, v, n - new + m, scale, softcap, window)
            got = out[starts[r] + m].cpu().double()
            torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_write_rows_writes_its_slots_only_and_skips_negative_ones() -> None:
    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(12, 2, 16, generator=gen, device="cpu").to(DEVICE)
    before = dst.clone()
    src = torch.randn(2, 4, 16, generator=gen).to(DEVICE).transpose(0, 1)  # [T, H, D], strided as a model's
    slots = torch.tensor([5, -1, 0, 11], device=DEVICE)
    paged.write_rows(dst, src, slots)
    want = before.clone()
    want[[5, 0, 11]] = src[[0, 2, 3]]
    assert torch.equal(dst, want)


def test_a_split_count_covers_every_key_once() -> None:
    """Splits beyond the context are empty; a short context with many splits still sums to the same."""
    gen = torch.Generator().manual_seed(5)
    (d1, _), view, table, _ = layouts("mha", 1, 1, 16, torch.float32, gen, [3, 1])
    q = torch.randn(2, 1, d1, generator=gen).to(DEVICE)
    outs = []
    for splits in (1, 8):
        out = torch.empty(2, 1, 16, device=DEVICE)
        paged.decode(
            q, None, view, table.to(DEVICE), torch.tensor([3, 1], device=DEVICE), out, 0.25, splits=splits
        )
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
