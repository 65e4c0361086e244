"""`page_first` stacks (`kvtier.transfer.stacks`): several layers of each page in one copy through the
staging buffer, byte for byte against the layout's definition, destinations poisoned first."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from conftest import host_rows, on_device, poison_device, poison_host, same_bytes
from test_cache import fill

from kvtier.cache import CacheConfig, CacheController
from kvtier.errors import PlanError
from kvtier.pool import DevicePool, HostLayout, HostPool
from kvtier.pool.device import Direction
from kvtier.pool.rows import as_words
from kvtier.spec import preset
from kvtier.transfer import Planner, TransferPath, backup, kernels, load_layers, stacks
from kvtier.transfer.options import PathCosts

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_kernel = pytest.mark.skipif(not kernels.runs_on(DEVICE), reason="no CUDA and TRITON_INTERPRET is not 1")


def pools(ps: int, staging_pages: int = 64, wrapped: bool = False, spec_name: str = "tiny-dsa"):
    """A `page_first` host pool of 64 pages and a device pool of 48 (its own tensors, or wrapped ones
    allocated layer by layer)."""
    spec = preset(spec_name, ps)
    host = HostPool(spec, 64 * ps, HostLayout.PAGE_FIRST)
    if wrapped:
        tensors = {
            b.name: [torch.zeros((48 * ps, *b.row_shape), dtype=b.dtype, device=DEVICE) for _ in b.layers]
            for b in spec.buffers
        }
        dev = DevicePool.wrap(spec, tensors, staging_tokens=staging_pages * ps)
    else:
        dev = DevicePool(spec, 48 * ps, DEVICE, staging_tokens=staging_pages * ps)
    return spec, host, dev


def pages(heads: list[int], ps: int) -> torch.Tensor:
    """The slots of the pages numbered `heads`, in order."""
    return (torch.tensor(heads)[:, None] * ps + torch.arange(ps)).flatten()


HOST_PAGES = {
    "contiguous": list(range(5, 37)),
    "runs-3": [p for start in (40, 2, 20, 9, 30, 50) for p in range(start, start + 3)],
    "scattered": [61, 3, 17, 40, 8, 33, 25, 12, 55, 0],
}


def snapshot(host: HostPool, dev: DevicePool) -> tuple[dict, dict]:
    spec = host.spec
    chunks = {b.name: [c.clone() for c in host.chunks(b.name)] for b in spec.buffers}
    layers = {(b.name, layer): dev.layer(b.name, layer).clone() for b in spec.buffers for layer in b.layers}
    return chunks, layers


def check(direction: Direction, host: HostPool, dev: DevicePool, hs, ds, before) -> None:
    """Every row of the pairs landed, and nothing else on the destination changed."""
    chunks, layers = before
    spec = host.spec
    if direction is Direction.LOAD:
        for b in spec.buffers:
            for layer in b.layers:
                want = layers[(b.name, layer)].clone()
                want[on_device(ds)] = on_device(host_rows(host, b, layer, hs))
                assert same_bytes(dev.layer(b.name, layer), want), f"{b.name} layer {layer}"
        return
    for b in spec.buffers:
        (chunk,) = host.chunks(b.name)
        want = chunks[b.name][0].clone()
        for layer in b.layers:
            rows = layers[(b.name, layer)][on_device(ds)].cpu()
            want[hs // spec.page_size, b.local_layer(layer), hs % spec.page_size] = rows
        assert same_bytes(chunk, want), b.name


def run(direction: Direction, plan, host: HostPool, dev: DevicePool, calls: list[list[int]]) -> None:
    stream = torch.cuda.Stream() if CUDA else None  # batched copies refuse the default stream
    for layers in calls:
        if direction is Direction.LOAD:
            load_layers(plan, host, dev, layers, stream)
        else:
            backup(plan, dev, host, layers, stream)
    if CUDA:
        torch.cuda.synchronize()


ALL = [[0, 1, 2]]
CALLS = {"all": ALL, "pairs": [[0, 1], [2]], "one-by-one": [[0], [1], [2]], "gap": [[0, 2], [1]]}


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("host_set", list(HOST_PAGES))
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("wrapped", [False, True])
def test_forced_stacks_move_every_row_byte_for_byte(direction, ps, host_set, scattered, wrapped, gen) -> None:
    spec, host, dev = pools(ps, staging_pages=8, wrapped=wrapped)  # windows of a few pages
    poison_host(host, gen)
    poison_device(dev, gen)
    heads = HOST_PAGES[host_set]
    dev_heads = (
        torch.randperm(48, generator=gen)[: len(heads)].tolist() if scattered else list(range(len(heads)))
    )
    hs, ds = pages(heads, ps), pages(dev_heads, ps)
    plan = Planner(host, dev, force=TransferPath.STACKED).plan(direction, hs, ds, layers_per_call=3)
    assert plan.path is TransferPath.STACKED and plan.layers_per_call == 3
    assert plan.mechanisms_by_buffer() == {b.name: {"stacked": len(hs)} for b in spec.buffers}
    before = snapshot(host, dev)
    run(direction, plan, host, dev, ALL)
    check(direction, host, dev, hs, ds, before)


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("calls", list(CALLS))
def test_calls_of_other_layers_than_planned_still_move_every_row(direction, calls, gen) -> None:
    """A plan made for calls of every layer, run two layers, one layer or a gap at a time."""
    _, host, dev = pools(2, staging_pages=5)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = pages(list(range(10, 30)), 2), pages(torch.randperm(48, generator=gen)[:20].tolist(), 2)
    plan = Planner(host, dev, force=TransferPath.STACKED).plan(direction, hs, ds, layers_per_call=3)
    before = snapshot(host, dev)
    run(direction, plan, host, dev, CALLS[calls])
    check(direction, host, dev, hs, ds, before)


def test_a_staging_buffer_that_holds_a_few_layers_splits_a_call_into_spans(gen) -> None:
    """Half the staging (8 rows of the 132-byte indexer: 528 B) holds one 4-slot page of 2 layers of the
    48-byte rows, of 1 layer of the indexer's: spans of 2 layers and of 1."""
    _, host, dev = pools(4, staging_pages=2)
    poison_host(host, gen)
    poison_device(dev, gen)
    hs, ds = pages(list(range(3, 9)), 4), pages([7, 1, 2, 3, 0, 9], 4)
    plan = Planner(host, dev, force=TransferPath.STACKED).plan(Direction.LOAD, hs, ds, layers_per_call=3)
    (part,) = plan.parts
    assert part.runs["kv"].layers == 2 and len(part.runs["kv"].windows) == 6
    assert part.runs["indexer"].layers == 1
    before = snapshot(host, dev)
    run(Direction.LOAD, plan, host, dev, ALL)
    check(Direction.LOAD, host, dev, hs, ds, before)


@needs_kernel
@pytest.mark.parametrize("direction", list(Direction))
def test_the_planner_stacks_the_buffers_whose_runs_are_worth_one_copy(direction, gen) -> None:
    """Calls of every layer: runs of 8 pages of the indexer's 2 layers of 132 B (2112 B a run) reach a
    `stack_min_bytes` of 1500, the 48-byte rows' 3 layers (1152 B) do not and go to the kernel; one
    layer a call plans no stacks; calls of 2 layers make 2-D copies of the 48-byte rows' lines of
    96 B (768 B a run) only from a `stack_line_min_bytes` of 96."""
    _, host, dev = pools(1)
    poison_host(host, gen)
    poison_device(dev, gen)
    heads = [p for start in (40, 2, 20, 30) for p in range(start, start + 8)]
    hs, ds = pages(heads, 1), torch.randperm(48, generator=gen)[:32]
    costs = PathCosts(stack_min_bytes=1500)
    planner = Planner(host, dev, costs=costs, use_kernel=True)
    plan = planner.plan(direction, hs, ds, layers_per_call=3)
    assert plan.path is TransferPath.MIXED
    by = plan.mechanisms_by_buffer()
    assert by["indexer"] == {"stacked": 32} and "stacked" not in by["kv"]
    before = snapshot(host, dev)
    run(direction, plan, host, dev, ALL)
    check(direction, host, dev, hs, ds, before)
    assert "stacked" not in str(planner.plan(direction, hs, ds).mechanisms_by_buffer())
    # Calls of fewer layers than the buffer's: 2-D copies, from lines of `stack_line_min_bytes`.
    wide = Planner(host, dev, costs=PathCosts(stack_min_bytes=700, stack_line_min_bytes=96), use_kernel=True)
    assert wide.plan(direction, hs, ds, layers_per_call=2).mechanisms_by_buffer()["kv"] == {"stacked": 32}
    narrow = Planner(
        host, dev, costs=PathCosts(stack_min_bytes=700, stack_line_min_bytes=97), use_kernel=True
    )
    assert "stacked" not in narrow.plan(direction, hs, ds, layers_per_call=2).mechanisms_by_buffer()["kv"]


def test_forcing_stacks_is_refused_where_they_cannot_move_the_rows(gen) -> None:
    spec = preset("tiny-dsa", 4)
    layer_first = HostPool(spec, 64, HostLayout.LAYER_FIRST)
    dev = DevicePool(spec, 64, DEVICE)
    forced = Planner(layer_first, dev, force=TransferPath.STACKED)
    with pytest.raises(PlanError, match="page_first"):
        forced.plan(Direction.LOAD, torch.arange(8), torch.arange(8), layers_per_call=3)
    _, host, dev = pools(4)
    forced = Planner(host, dev, force=TransferPath.STACKED)
    with pytest.raises(PlanError, match="whole pages"):
        forced.plan(Direction.LOAD, torch.arange(1, 9), torch.arange(8), layers_per_call=3)
    with pytest.raises(PlanError, match="layers_per_call"):
        forced.plan(Direction.LOAD, torch.arange(8), torch.arange(8), layers_per_call=0)
    tiny = DevicePool(spec, 64, DEVICE, staging_tokens=1)  # half of it holds no page of one layer
    with pytest.raises(PlanError, match="staging"):
        Planner(host, tiny, force=TransferPath.STACKED).plan(Direction.LOAD, torch.arange(8), torch.arange(8))


@needs_kernel
@pytest.mark.parametrize("per_load", [2, 3])
@pytest.mark.parametrize(
    "forced",
    [pytest.param(False, marks=pytest.mark.skipif(not CUDA, reason="the CPU plans by estimates")), True],
)
def test_the_cache_backs_up_and_reloads_page_first_prefixes_as_stacks(per_load, forced, monkeypatch) -> None:
    """A `page_first` cache whose planner stacks every run (`stack_min_bytes` of 1 on CUDA, or forced):
    the backup of every layer in one call and loads of `per_load` layers move as stacks, and every
    layer's rows come back byte for byte into poisoned slots."""
    calls: list[Direction] = []
    real = stacks.move
    monkeypatch.setattr(stacks, "move", lambda direction, *a: (calls.append(direction), real(direction, *a)))
    spec = preset("tiny-dsa", 2)
    config = CacheConfig(layers_per_load=per_load, costs=PathCosts(stack_min_bytes=1))
    if forced:
        config = CacheConfig(layers_per_load=per_load, force_path=TransferPath.STACKED)
    c = CacheController(DevicePool(spec, 32, DEVICE), HostPool(spec, 64, "page_first"), config)
    tokens = tuple(range(12))
    slots = fill(c, tokens)
    want = {(b.name, layer): as_words(c.device_pool.layer(b.name, layer))[slots].clone() for b in spec.buffers
            for layer in b.layers}  # fmt: skip
    c.flush()
    assert Direction.BACKUP in calls
    c.evict_device(len(tokens))
    for key in want:
        w = as_words(c.device_pool.layer(*key))
        w.copy_(~w)
    h = c.load_back(c.match(tokens))
    for layer in range(spec.num_layers):
        h.wait_layer(layer)
    assert Direction.LOAD in calls
    for (name, layer), rows_before in want.items():
        assert torch.equal(as_words(c.device_pool.layer(name, layer))[h.device_slots], rows_before), (
            name,
            layer,
        )
