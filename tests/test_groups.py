"""The layer-group kernel (`copy_groups`), bit for bit against plain torch indexing.

The host side is a `page_first` page of `L` layers (`[slots, L, row]` at page size 1),
the device side one tensor per layer, allocated separately (their addresses lie in any
order). Destinations are poisoned first, so a row the kernel fails to write shows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from conftest import on_device, on_host

from kvtier.errors import ConfigError, TransferError
from kvtier.pool.device import Direction
from kvtier.pool.rows import word_dtype
from kvtier.transfer import groups
from kvtier.transfer.execute import layer_spans
from kvtier.transfer.kernels import runs_on

CUDA = torch.cuda.is_available()
if not runs_on(torch.device("cuda" if CUDA else "cpu")):  # pragma: no cover - depends on the environment
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)


class Case:
    """`slots` host slots of `L` layers of `row_bytes`-byte rows; `G` device layers of `dev_slots` rows."""

    def __init__(
        self, row_bytes: int, L: int, lo: int, hi: int, n: int, gen: torch.Generator, one_allocation=False
    ) -> None:
        self.dtype = word_dtype(row_bytes)
        self.rw = row_bytes // torch.empty((), dtype=self.dtype).element_size()
        self.L, self.lo, self.hi, self.n = L, lo, hi, n
        slots, dev_slots = 3 * n, 2 * n + 1
        self.host = on_host(self._random(slots * L * self.rw, gen))
        if one_allocation:  # as DevicePool makes them: evenly spaced, addressed by a stride
            self.layers = list(
                on_device(self._random((hi - lo) * dev_slots * self.rw, gen)).view(hi - lo, -1)
            )
        else:
            # One allocation per layer, of unequal sizes, in an order unrelated to the layers'
            # (negative offsets too): addressed through a table.
            allocated = [
                on_device(self._random((dev_slots + 7 * j) * self.rw, gen))[: dev_slots * self.rw]
                for j in range(hi - lo)
            ]
            order = torch.randperm(hi - lo, generator=gen).tolist()
            self.layers = [allocated[i] for i in order]
        self.hs = torch.randperm(slots, generator=gen)[:n]
        self.ds = torch.randperm(dev_slots, generator=gen)[:n]

    def _random(self, numel: int, gen: torch.Generator) -> torch.Tensor:
        size = torch.empty((), dtype=self.dtype).element_size()
        return torch.randint(0, 256, (numel * size,), generator=gen).to(torch.uint8).view(self.dtype)

    def host_rows(self) -> torch.Tensor:
        """`[slots, L, rw]` view of the host side."""
        return self.host.view(-1, self.L, self.rw)

    def run(self, direction: Direction, **kw) -> None:
        groups.copy_groups(
            self.host,
            self.hs * (self.L * self.rw),
            self.layers,
            self.ds * self.rw,
            self.rw,
            direction,
            packed_shift=self.lo * self.rw,
            **kw,
        )
        if CUDA:
            torch.cuda.synchronize()


# Row sizes: the DSA indexer (4-byte aligned; stretches unaligned), packed fp8 MLA, bf16 MLA,
# an odd 6-byte sidecar (2-byte words), a single byte.
ROWS = [132, 656, 1152, 6, 1]


@pytest.mark.parametrize("row_bytes", ROWS)
@pytest.mark.parametrize(("L", "lo", "hi"), [(5, 0, 5), (7, 2, 6), (3, 1, 2)])
@pytest.mark.parametrize("units", [None, 3])
@pytest.mark.parametrize("one_allocation", [False, True])
def test_load_matches_indexing(row_bytes, L, lo, hi, units, one_allocation, gen) -> None:
    c = Case(row_bytes, L, lo, hi, 37, gen, one_allocation)
    before = [t.clone() for t in c.layers]
    c.run(Direction.LOAD, units_per_program=units)
    expect = c.host_rows()[c.hs][:, lo:hi]  # [n, G, rw]
    for j, t in enumerate(c.layers):
        want = before[j].view(-1, c.rw).clone()
        want[on_device(c.ds)] = on_device(expect[:, j])
        assert torch.equal(t.view(-1, c.rw), want), f"layer {lo + j}"


@pytest.mark.parametrize("row_bytes", ROWS)
@pytest.mark.parametrize(("L", "lo", "hi"), [(5, 0, 5), (7, 2, 6), (3, 1, 2)])
@pytest.mark.parametrize("units", [None, 3])
@pytest.mark.parametrize("one_allocation", [False, True])
def test_backup_matches_indexing(row_bytes, L, lo, hi, units, one_allocation, gen) -> None:
    c = Case(row_bytes, L, lo, hi, 37, gen, one_allocation)
    want = c.host_rows().clone()
    for j, t in enumerate(c.layers):
        want[c.hs, lo + j] = t.view(-1, c.rw)[on_device(c.ds)].cpu()
    c.run(Direction.BACKUP, units_per_program=units)
    # Every other host word, the neighbours of each stretch included, keeps its bytes.
    assert torch.equal(c.host_rows(), want)


@pytest.mark.parametrize("one_allocation", [False, True])
def test_layers_of_one_allocation_go_by_a_stride_others_by_a_table(one_allocation, gen, monkeypatch) -> None:
    c = Case(132, 6, 0, 5, 9, gen, one_allocation)
    seen: list[dict] = []
    real = groups._kernel

    class Recorder:
        """Stands in for the jitted kernel: records each launch's keyword arguments, then launches."""

        def __getitem__(self, grid):
            def launch(*args, **kwargs) -> None:
                seen.append(kwargs)
                real()[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(groups, "_kernel", Recorder)
    c.run(Direction.LOAD)
    (kwargs,) = seen
    assert kwargs["STRIDED"] is one_allocation
    assert kwargs["ALIGNED"] is False  # 132-byte rows: 33 words, not whole 16-byte chunks


def test_offsets_on_the_device_with_a_table_uploaded_once(gen) -> None:
    c = Case(132, 6, 1, 5, 20, gen)
    base = c.layers[0]
    offsets = groups.layer_offsets([base, *c.layers])[1:]
    table = (base, on_device(torch.tensor(offsets)))
    groups.copy_groups(
        c.host,
        on_device(c.hs * (c.L * c.rw)),
        c.layers,
        on_device(c.ds * c.rw),
        c.rw,
        Direction.LOAD,
        packed_shift=c.lo * c.rw,
        table=table,
        validate=False,
        offsets_align=c.rw,
    )
    expect = c.host_rows()[c.hs][:, 1:5]
    for j, t in enumerate(c.layers):
        assert torch.equal(t.view(-1, c.rw)[on_device(c.ds)].cpu(), expect[:, j])


def _unchanged(c: Case, call) -> None:
    host, layers = c.host.clone(), [t.clone() for t in c.layers]
    call()
    assert torch.equal(c.host, host) and all(torch.equal(a, b) for a, b in zip(c.layers, layers, strict=True))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"packed_offsets": "past"}, "packed_offsets"),
        ({"split_offsets": "past"}, "split_offsets"),
        ({"split_offsets": "repeat"}, "repeated"),
        ({"packed_shift": -1}, "packed_shift"),
        ({"unit_words": 0}, "unit_words"),
    ],
)
def test_bad_calls_raise_before_anything_is_written(change, message, gen) -> None:
    c = Case(132, 4, 0, 4, 10, gen)
    args = {
        "packed_offsets": c.hs * (c.L * c.rw),
        "split_offsets": c.ds * c.rw,
        "packed_shift": 0,
        "unit_words": c.rw,
    }
    if change.get("packed_offsets") == "past":
        args["packed_offsets"] = args["packed_offsets"].clone()
        args["packed_offsets"][3] = c.host.numel()
    elif change.get("split_offsets") == "past":
        args["split_offsets"] = args["split_offsets"].clone()
        args["split_offsets"][5] = c.layers[0].numel()
    elif change.get("split_offsets") == "repeat":
        args["split_offsets"] = args["split_offsets"].clone()
        args["split_offsets"][1] = args["split_offsets"][0]
    else:
        args.update(change)

    def call() -> None:
        groups.copy_groups(
            c.host,
            args["packed_offsets"],
            c.layers,
            args["split_offsets"],
            args["unit_words"],
            Direction.LOAD,
            packed_shift=args["packed_shift"],
        )

    with pytest.raises((TransferError, ConfigError), match=message):
        _unchanged(c, call)


def test_backups_refuse_overlapping_stretches(gen) -> None:
    c = Case(132, 4, 0, 4, 10, gen)
    packed = c.hs * (c.L * c.rw)
    packed[2] = packed[1] + 1  # overlaps unit 1's stretch

    def call() -> None:
        groups.copy_groups(c.host, packed, c.layers, c.ds * c.rw, c.rw, Direction.BACKUP)

    with pytest.raises(TransferError, match="packed_offsets"):
        _unchanged(c, call)


def test_layers_of_other_dtypes_or_a_wrong_table_are_refused(gen) -> None:
    c = Case(132, 4, 0, 4, 10, gen)
    odd = [c.layers[0], c.layers[1].view(torch.int16)]
    with pytest.raises(TransferError, match="layers"):
        groups.copy_groups(c.host, c.hs * c.L * c.rw, odd, c.ds * c.rw, c.rw, Direction.LOAD)
    short = (c.layers[0], on_device(torch.zeros(2, dtype=torch.int64)))
    packed, split = c.hs * c.L * c.rw, c.ds * c.rw
    with pytest.raises(TransferError, match="table"):
        groups.copy_groups(c.host, packed, c.layers, split, c.rw, Direction.LOAD, table=short)
    with pytest.raises(TransferError, match="at least one layer"):
        groups.copy_groups(c.host, c.hs * c.L * c.rw, [], c.ds * c.rw, c.rw, Direction.LOAD)


def test_a_stretch_wider_than_a_tile_is_refused(gen) -> None:
    c = Case(132, 4, 0, 4, 4, gen)
    with pytest.raises(TransferError, match="wider than one tile"):
        groups.copy_groups(c.host, c.hs * 0, c.layers, c.ds * 0, 17000, Direction.LOAD, validate=False)


def test_units_in_flight_fill_a_tile() -> None:
    assert groups.units_in_flight(16 * 132) == 38  # ~80 KiB per program
    assert groups.units_in_flight(78 * 132) == 7
    assert groups.units_in_flight(61 * 1152) == 1


def test_layer_spans_split_at_gaps_and_at_the_cap() -> None:
    assert layer_spans([0, 1, 2, 4, 5], 2) == [(0, 2), (2, 3), (4, 6)]
    assert layer_spans([3], 8) == [(3, 4)]
    assert layer_spans([0, 1, 2, 3], 8) == [(0, 4)]
