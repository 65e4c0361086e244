"""Host and device pools: layouts, chunking, memory budget, pinning rules, footprint, close."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import random_rows, same_bytes

from kvtier.errors import ClosedError, HostMemoryError, LayoutError, PinError, SlotError, SpecError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.memory import host_memory_bytes
from kvtier.spec import preset


@pytest.mark.parametrize("ps", [1, 4])
def test_layouts_place_rows_where_they_say(ps: int, gen) -> None:
    spec = preset("tiny-dsa", ps)
    for layout, shape_of in [
        (HostLayout.LAYER_FIRST, lambda b: (len(b.layers), 32, *b.row_shape)),
        (HostLayout.PAGE_FIRST, lambda b: (32 // ps, len(b.layers), ps, *b.row_shape)),
    ]:
        pool = HostPool(spec, 32, layout)
        for b in spec.buffers:
            (chunk,) = pool.chunks(b.name)
            assert tuple(chunk.shape) == shape_of(b) and chunk.dtype == b.dtype
            slots = torch.tensor([0, 5, 31])
            rows = random_rows(3, b, gen)
            layer = b.layers[-1]
            pool.scatter(b.name, layer, slots, rows)
            j = len(b.layers) - 1
            for i, s in enumerate(slots.tolist()):
                stored = chunk[j, s] if layout is HostLayout.LAYER_FIRST else chunk[s // ps, j, s % ps]
                assert same_bytes(stored, rows[i])
            assert same_bytes(pool.gather(b.name, layer, slots), rows)


def test_chunks_never_exceed_the_limit() -> None:
    spec = preset("tiny-dsa", 2)
    for layout in HostLayout:
        pool = HostPool(spec, 1000, layout, chunk_bytes=3000)
        for b in spec.buffers:
            assert all(c.nbytes <= 3000 for c in pool.chunks(b.name))
        assert pool.footprint_bytes == sum(c.nbytes for b in spec.buffers for c in pool.chunks(b.name))
        assert pool.footprint_bytes == 1000 * spec.bytes_per_token()
    # Layer-first: as many whole pages of the widest row (the indexer's 132 B) as a chunk holds.
    assert HostPool(spec, 1000, "layer_first", chunk_bytes=3000).segment_slots == 22
    assert HostPool(spec, 1000, "page_first", chunk_bytes=3000).segment_slots == 2


def test_a_pool_too_large_for_the_host_is_refused_naming_both_numbers() -> None:
    available, _ = host_memory_bytes()
    spec = preset("deepseek-v3")
    slots = available // spec.bytes_per_token() + 1024
    with pytest.raises(HostMemoryError, match=r"needs .* GiB but only .* GiB may be used"):
        HostPool(spec, slots)
    with pytest.raises(HostMemoryError, match="reserve"):
        HostPool(preset("tiny-mla"), 64, reserve_bytes=4 * available)  # memory may grow meanwhile


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA rule")
def test_pinning_without_cuda_is_an_error_not_a_fallback() -> None:
    with pytest.raises(PinError, match="needs CUDA"):
        HostPool(preset("tiny-mla"), 64, pin=True)
    assert not HostPool(preset("tiny-mla"), 64).pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_pool_is_pinned_with_cuda() -> None:
    pool = HostPool(preset("tiny-mla"), 64)
    assert pool.pinned and all(c.is_pinned() for c in pool.chunks("kv"))


def test_bad_pool_arguments() -> None:
    with pytest.raises(LayoutError, match="unknown host layout"):
        HostPool(preset("tiny-mla"), 64, "row_major")
    with pytest.raises(SpecError, match="multiple of page_size"):
        HostPool(preset("tiny-mla", 16), 40)
    with pytest.raises(SpecError, match="exceeds a chunk"):
        HostPool(preset("tiny-mla", 64), 128, "page_first", chunk_bytes=1024)
    with pytest.raises(SpecError, match="positive"):
        DevicePool(preset("tiny-mla"), 0)


def test_progress_is_reported_per_chunk() -> None:
    seen = []
    pool = HostPool(
        preset("tiny-mla"),
        512,
        chunk_bytes=8192,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert len(seen) == len(pool.chunks("kv")) > 1
    assert seen[-1] == (pool.footprint_bytes, pool.footprint_bytes)


def test_device_pool_counts_its_rows_and_nothing_else() -> None:
    spec = preset("tiny-dsa")
    pool = DevicePool(spec, 100)
    # tiny-dsa: a 24-value bf16 latent on 3 layers and a 132-byte indexer row on 2.
    assert pool.footprint_bytes == 100 * (3 * 48 + 2 * 132)
    assert pool.layer("indexer", 2).shape == (100, 132)
    with pytest.raises(SpecError, match="no layer 1"):
        pool.layer("indexer", 1)


def test_wrap_checks_shapes() -> None:
    spec = preset("tiny-mha")
    good = {n: [torch.zeros(8, 2, 8, dtype=torch.bfloat16) for _ in range(2)] for n in ("k", "v")}
    assert DevicePool.wrap(spec, good).num_slots == 8
    bad = dict(good, v=[torch.zeros(8, 2, 4, dtype=torch.bfloat16)] * 2)
    with pytest.raises(SpecError, match="does not match"):
        DevicePool.wrap(spec, bad)
    with pytest.raises(SpecError, match="needs 2 tensors"):
        DevicePool.wrap(spec, dict(good, v=good["v"][:1]))


@pytest.mark.parametrize("layout", list(HostLayout))
def test_a_closed_host_pool_holds_no_memory_and_refuses_every_access(layout: HostLayout) -> None:
    spec = preset("tiny-dsa", 2)
    pool = HostPool(spec, 64, layout, chunk_bytes=2048)
    refs = [weakref.ref(c) for b in spec.buffers for c in pool.chunks(b.name)]
    assert len(refs) > 2 and not pool.closed
    slots = torch.tensor([0, 3])
    rows = pool.gather("kv", 0, slots)
    pool.close()
    gc.collect()
    assert pool.closed and all(r() is None for r in refs)  # no chunk is referenced any more
    accesses = [
        lambda: pool.chunks("kv"),
        lambda: pool.segment("kv", 0, 0),
        lambda: pool.locate("kv", np.array([0], dtype=np.int64)),
        lambda: pool.row_map("kv"),
        lambda: pool.region_ptrs("kv"),
        lambda: pool.region_classes("kv"),
        lambda: pool.region_words("kv", 0, 0),
        lambda: pool.gather("kv", 0, slots),
        lambda: pool.scatter("kv", 0, slots, rows),
    ]
    for access in accesses:
        with pytest.raises(ClosedError, match="closed"):
            access()
    pool.close()  # idempotent
    assert "closed" in repr(pool)


def test_a_host_pool_closes_when_its_block_ends_even_on_an_error() -> None:
    with pytest.raises(KeyError), HostPool(preset("tiny-mla"), 64) as pool:
        assert not pool.closed
        raise KeyError("boom")
    assert pool.closed


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4096, 1000])
@pytest.mark.parametrize("layout", list(HostLayout))
def test_region_classes_give_every_layer_its_regions_distances_from_the_first(layout, chunk_bytes) -> None:
    """`region_classes`: each layer's row of `region_ptrs` less its first region equals its class's
    row; the classes are distinct; a pool of one chunk per buffer has one class."""
    spec = preset("tiny-dsa", 2)
    pool = HostPool(spec, 256, layout, chunk_bytes=chunk_bytes)
    for b in spec.buffers:
        ptrs = pool.region_ptrs(b.name)
        classes, layer_class = pool.region_classes(b.name)
        assert layer_class.shape == (len(b.layers),) and classes.shape[1] == ptrs.shape[1]
        for j in range(len(b.layers)):
            assert (ptrs[j] - ptrs[j, 0] == classes[layer_class[j]]).all()
        assert len({tuple(c) for c in classes.tolist()}) == len(classes)
        assert set(layer_class.tolist()) == set(range(len(classes)))
        if len(pool.chunks(b.name)) == 1:
            assert len(classes) == 1 and (classes == 0).all()


def test_region_pointers_are_read_only() -> None:
    pool = HostPool(preset("tiny-mla"), 64)
    with pytest.raises(ValueError, match="read-only"):
        pool.region_ptrs("kv")[0, 0] = 0


def test_a_closed_device_pool_drops_its_tensors_and_refuses_access() -> None:
    spec = preset("tiny-dsa")
    with DevicePool(spec, 32) as pool:
        refs = [weakref.ref(pool.layer("kv", 0)), weakref.ref(pool.layer("indexer", 2))]
        assert pool.layer_ptrs("indexer").shape == (2,)
    gc.collect()
    assert pool.closed and all(r() is None for r in refs)
    for access in (
        lambda: pool.layer("kv", 0),
        lambda: pool.raw_rows("kv"),
        lambda: pool.layer_ptrs("kv"),
    ):
        with pytest.raises(ClosedError, match="device pool"):
            access()
    pool.close()  # idempotent


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("spec_name", ["tiny-mha", "tiny-dsa"])
def test_page_views_hold_a_page_buffer_by_buffer_layer_by_layer(layout: str, spec_name: str) -> None:
    """A storage value's payload order, read through the views, over pools cut into many chunks."""
    spec = preset(spec_name, page_size=4)
    pool = HostPool(spec, 64, layout, chunk_bytes=3 * 4 * spec.num_layers * spec.widest_row_bytes)
    assert sum(len(pool.chunks(b.name)) for b in spec.buffers) > len(spec.buffers)  # several chunks
    gen = torch.Generator().manual_seed(3)
    for b in spec.buffers:
        for chunk in pool.chunks(b.name):
            raw = chunk.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    for slot in range(0, 64, 4):
        slots = torch.arange(slot, slot + 4)
        want = b"".join(
            pool.gather(b.name, layer, slots).contiguous().view(torch.uint8).numpy().tobytes()
            for b in spec.buffers
            for layer in b.layers
        )
        assert b"".join(bytes(v) for v in pool.page_views(slot)) == want
    with pytest.raises(SlotError):
        pool.page_views(2)  # not a page's first slot
