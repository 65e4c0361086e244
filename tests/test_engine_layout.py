"""A step's host-side metadata: `HostLayout.of` (the paged path's positions, write slots and slot
tables), the CUDA graphs' staging into their static buffers (`kvtier.engine.graphs.fill`, here
over CPU tensors), and `Request.span` / `token_at`, each against a plain construction piece by piece."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.engine.graphs import fill, static_layout
from kvtier.engine.paged_step import HostLayout
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Request
from kvtier.errors import InvariantError


def pieces_of(decodes: int, prefills: int, seed: int) -> tuple[list[tuple[np.ndarray, int]], np.ndarray]:
    """`decodes` one-token pieces then `prefills` longer ones, random slot tables and ids."""
    rng = np.random.default_rng(seed)
    pieces = [(rng.permutation(4096)[: rng.integers(1, 300)], 1) for _ in range(decodes)]
    for _ in range(prefills):
        n = int(rng.integers(2, 300))
        pieces.append((rng.permutation(4096)[: n + rng.integers(0, 200)], n))
    ids = rng.integers(0, 1000, sum(n for _, n in pieces))
    return pieces, ids


def reference(pieces: list[tuple[np.ndarray, int]], ids: np.ndarray) -> dict[str, np.ndarray]:
    """The layout's arrays built one piece at a time."""
    b = next((i for i, (_, n) in enumerate(pieces) if n != 1), len(pieces))

    def table(rows):
        out = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out

    ends = np.cumsum([n for _, n in pieces])
    return {
        "ids": ids,
        "positions": np.concatenate([np.arange(len(s) - n, len(s)) for s, n in pieces]),
        "write": np.concatenate([s[len(s) - n :] for s, n in pieces]),
        "last": ends - 1,
        "dec_table": table([s for s, _ in pieces[:b]]),
        "dec_lens": np.array([len(s) for s, _ in pieces[:b]], np.int64),
        "pf_table": table([s for s, _ in pieces[b:]]),
        "pf_lens": np.array([len(s) for s, _ in pieces[b:]], np.int64),
        "pf_news": np.array([n for _, n in pieces[b:]], np.int64),
        "pf_starts": np.array([e - n for e, (_, n) in zip(ends, pieces, strict=True)][b:], np.int64),
    }


@pytest.mark.parametrize("decodes, prefills", [(1, 0), (64, 0), (0, 1), (0, 3), (5, 2), (1, 1)])
def test_host_layout_equals_the_piece_by_piece_construction(decodes: int, prefills: int) -> None:
    pieces, ids = pieces_of(decodes, prefills, seed=decodes * 10 + prefills)
    host = HostLayout.of(pieces, ids)
    want = reference(pieces, ids)
    assert host.arrays.keys() == want.keys()
    for name, a in want.items():
        got = host.arrays[name]
        assert got.dtype == np.int64 and got.shape == a.shape, name
        np.testing.assert_array_equal(got, a, err_msg=name)
    assert host.max_new == max((n for _, n in pieces[decodes:]), default=0)
    assert host.decode_only == (prefills == 0)


def test_host_layout_refuses_a_piece_longer_than_its_context() -> None:
    with pytest.raises(InvariantError):
        HostLayout.of([(np.arange(3), 1), (np.arange(2), 5)], np.zeros(6, np.int64))


@pytest.mark.parametrize("decodes, bucket", [(1, 1), (3, 4), (16, 16), (20, 32)])
def test_graph_fill_writes_the_step_and_its_padding_and_nothing_else(decodes: int, bucket: int) -> None:
    pieces, ids = pieces_of(decodes, 0, seed=decodes)
    host = HostLayout.of(pieces, ids)
    width = 512
    head, layout = static_layout(bucket, width, torch.device("cpu"))
    poison = 7777
    head.fill_(poison)
    layout.dec_table.fill_(poison)
    fill(head, layout, host)
    a, b = host.arrays, decodes
    w = a["dec_table"].shape[1]

    def padded(x, value):
        return np.concatenate([x, np.full(bucket - b, value, np.int64)])

    np.testing.assert_array_equal(layout.ids.numpy(), padded(a["ids"], 0))
    np.testing.assert_array_equal(layout.positions.numpy(), padded(a["positions"], 0))
    np.testing.assert_array_equal(layout.write.numpy(), padded(a["write"], -1))
    np.testing.assert_array_equal(layout.dec_lens.numpy(), padded(a["dec_lens"], 0))
    table = layout.dec_table.numpy()
    np.testing.assert_array_equal(table[:b, :w], a["dec_table"])
    assert (table[b:] == poison).all() and (table[:, w:] == poison).all()  # only the step's corner
    assert layout.last.tolist() == list(range(bucket))


def test_a_fresh_static_layout_is_all_padding() -> None:
    head, layout = static_layout(4, 8, torch.device("cpu"))
    assert layout.write.tolist() == [-1] * 4 and layout.dec_lens.tolist() == [0] * 4
    assert (layout.dec_table == -1).all() and layout.decodes == 4
    layout.ids[1] = 5  # the layout's rows are `head`'s
    assert head[0, 1] == 5


def test_a_requests_span_is_the_slice_of_its_context() -> None:
    req = Request(1, np.arange(100, 110, dtype=np.int64), SamplingParams(), 0.0)
    req.tokens = [7, 8, 9]
    n = req.context_len
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            got = req.span(lo, hi)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, req.context(hi)[lo:])
    assert [req.token_at(i) for i in range(n)] == req.context().tolist()
