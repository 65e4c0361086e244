"""`HostChunks`, a host pool's memory: every row in exactly one chunk, and a failed allocation undone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvtier.errors import HostMemoryError, InvariantError
from kvtier.pool import chunks as chunks_module
from kvtier.pool.chunks import HostChunks, HostLayout
from kvtier.spec import preset


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 3000, 1000])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_every_row_of_every_layer_lies_in_exactly_one_chunk(layout: HostLayout, chunk_bytes: int) -> None:
    spec = preset("tiny-dsa", 2)
    chunks = HostChunks(spec, 200, layout, chunk_bytes, pinned=False, reserve_bytes=0, progress=None)
    for b in spec.buffers:
        held = torch.zeros(len(b.layers), 200, dtype=torch.int64)
        for c in chunks.of(b.name):
            held[c.layer_lo : c.layer_hi, c.slot_lo : c.slot_hi] += 1
            assert c.tensor.nbytes <= chunk_bytes
        assert (held == 1).all()
        for local in range(len(b.layers)):
            for slot in (0, 1, 57, 199):
                c = chunks.at(b.name, local, slot)
                assert c.layer_lo <= local < c.layer_hi and c.slot_lo <= slot < c.slot_hi
    with pytest.raises(InvariantError, match="no chunk holds slot 200"):
        chunks.at("kv", 0, 200)
    assert chunks.footprint_bytes == 200 * spec.bytes_per_token()


def test_a_failed_allocation_frees_the_chunks_made_before_it_before_returning_memory(monkeypatch) -> None:
    """The third chunk fails: when the freed memory is handed back to the OS (with the error on its
    way up, its traceback holding the allocating frame), the two chunks made before are unreferenced."""
    made: list[weakref.ref] = []
    alive_at_return: list[int] = []
    allocate = HostChunks._allocate

    def failing(self: HostChunks, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if len(made) == 2:
            raise HostMemoryError("no memory for a third chunk")
        t = allocate(self, shape, dtype)
        made.append(weakref.ref(t))
        return t

    def returned(pinned: bool) -> None:
        gc.collect()
        alive_at_return.append(sum(r() is not None for r in made))

    monkeypatch.setattr(HostChunks, "_allocate", failing)
    monkeypatch.setattr(chunks_module, "return_freed_memory", returned)
    with pytest.raises(HostMemoryError, match="third chunk"):
        HostChunks(preset("tiny-mla"), 512, HostLayout.LAYER_FIRST, 8192, False, 0, None)
    assert len(made) == 2 and alive_at_return == [0]
