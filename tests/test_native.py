"""The compiled submission loop: its calls against a model made from tensor views, with stand-in
runtime functions."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import poison_device, same_bytes

from kvtier.cache import CacheConfig, CacheController, DeviceHostMover, NodeState
from kvtier.errors import CudaRuntimeError, PlanError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.device import Direction
from kvtier.spec import preset
from kvtier.transfer import PathCosts, TransferPath, dma, native
from kvtier.transfer.cudart import MEMCPY_DEFAULT
from kvtier.transfer.lanes import DeferredLane, Signal
from kvtier.transfer.native import loop_takes, run_buffers, run_layers
from kvtier.transfer.plan import Planner

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)

VP, SZ = ctypes.c_void_p, ctypes.c_size_t
COPY_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, SZ, ctypes.c_int, VP)
BATCH_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, VP, SZ, VP, VP, SZ, VP)
RECORD_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP)
WAIT_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, ctypes.c_uint)
ATTRS = 0xA77


class FakeRuntime:
    """Runtime entry points that log their calls; `fail_at`: the call (0-based) that returns 700;
    `move`: copies move their bytes at once (for pools in CPU memory), records and waits do nothing."""

    def __init__(self, fail_at: int | None = None, batch: bool = True, move: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at

        def log(*call) -> int:
            self.calls.append(call)
            if move and call[0] == "copy":  # CPU pools: every address is in this process's memory
                ctypes.memmove(call[1], call[2], call[3])
            elif move and call[0] == "batch":
                for dst, src, n in zip(*call[1:4], strict=True):
                    ctypes.memmove(dst, src, n)
            return 700 if len(self.calls) - 1 == self.fail_at else 0

        def batch_call(dsts, srcs, sizes, count, attrs, idx, nattrs, stream) -> int:
            read = [
                np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_int64)), (count,)).tolist()
                for p in (dsts, srcs, sizes)
            ]
            index = ctypes.cast(idx, ctypes.POINTER(ctypes.c_size_t))[0]
            return log("batch", *read, count, attrs, index, nattrs, stream)

        # Kept on the object: the loop calls them through raw pointers.
        self.fns = (
            COPY_T(lambda d, s, n, kind, st: log("copy", d, s, n, kind, st)),
            BATCH_T(batch_call) if batch else None,
            RECORD_T(lambda e, st: log("record", e, st)),
            WAIT_T(lambda st, e, flags: log("wait", st, e, flags)),
        )

    def native(self, lib: ctypes.CDLL) -> native.Native:
        addr = [ctypes.cast(f, ctypes.c_void_p).value if f is not None else 0 for f in self.fns]
        loop = native.Native(lib, *addr, attrs=ATTRS)
        loop.keep_alive = self  # type: ignore[attr-defined]  # the loop calls into self.fns
        return loop


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler")
    built = native.compile_library(tmp_path_factory.mktemp("native"))
    assert built is not None
    return built


def test_without_a_compiler_or_when_disabled_there_is_no_library(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.compile_library(tmp_path / "cache") is None
    try:
        native.LIBRARY.reset()
        monkeypatch.setenv("KVTIER_NATIVE", "0")
        assert native.library() is None
        native.LIBRARY.reset()
        monkeypatch.delenv("KVTIER_NATIVE")
        if not torch.cuda.is_available():
            assert native.library() is None  # no CUDA runtime in the process
    finally:
        native.LIBRARY.reset()


@needs_cc
def test_the_library_is_built_once_and_reused(tmp_path) -> None:
    first = native.compile_library(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert first is not None and len(built) == 1 and built[0].endswith(".so")
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    assert native.compile_library(tmp_path) is not None
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime


def expected_calls(runs, host, dev, direction, events, small, order=0xF0, current=9, stream=5) -> list:
    """The calls the loop must make for joint runs `(first host slot, first device slot, length)`:
    the ordering record and wait, then per layer each buffer's copies (one call per run, or one
    batch above `small` runs) and the layer's event (or one event after all). Addresses from
    tensor views of the pools, not from the plan's byte tables."""
    spec = host.spec
    seg = host.segment_slots
    calls = [("record", order, current), ("wait", stream, order, 0)]
    for layer in range(spec.num_layers):
        for b in spec.buffers_on(layer):
            triples = []
            for h, d, n in runs:
                host_ptr = host.segment(b.name, layer, h // seg)[h % seg].data_ptr()
                dev_ptr = dev.layer(b.name, layer)[d].data_ptr()
                pair = (dev_ptr, host_ptr) if direction is Direction.LOAD else (host_ptr, dev_ptr)
                triples.append((*pair, n * b.row_bytes))
            if len(triples) <= small:
                calls += [("copy", *t, MEMCPY_DEFAULT, stream) for t in triples]
            else:
                dst, src, nbytes = (list(x) for x in zip(*triples, strict=True))
                calls.append(("batch", dst, src, nbytes, len(triples), ATTRS, 0, 1, stream))
        if len(events) == spec.num_layers:
            calls.append(("record", events[layer], stream))
    if len(events) == 1 and spec.num_layers != 1:
        calls.append(("record", events[0], stream))
    return calls


def raw_planner(host: HostPool, dev: DevicePool, **kw) -> Planner:
    """A planner that plans raw copies, as on CUDA with a runtime: the stand-in runtime makes them
    (on CPU pools a `Planner` leaves its copies to torch, `batched` False, and plans none for the loop)."""
    planner = Planner(host, dev, **kw)
    planner.batched = True
    return planner


def joint_of(copies) -> list[tuple[int, int, int]]:
    return list(zip(*(copies.joint[i].tolist() for i in (1, 2, 3)), strict=True))


@needs_cc
@pytest.mark.parametrize("small", [1, 8])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("direction", ["load", "backup"])
@pytest.mark.parametrize("per_layer", [True, False])
def test_run_layers_makes_the_calls_of_its_runs(lib, small, layout, direction, per_layer, pin):
    """Addresses computed in the loop against tensor views of the same rows: the same calls, in order.

    A DSA spec (the indexer on some layers only), both host layouts (page-first cuts runs at
    every page), host runs over several regions (a small chunk size), batched and plain calls.
    """
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP, small_batch=small))
    spec = preset("tiny-dsa", 4)
    host = HostPool(spec, 1024, layout, chunk_bytes=16 << 10)
    assert host.num_segments() > 1
    dev = DevicePool(spec, 512)
    runs = ([(40, 80), (300, 80), (1000, 8)], [(0, 80), (200, 80), (400, 8)])
    n = sum(k for _, k in runs[0])
    copies = raw_planner(host, dev, force="copy").copies(n, runs)
    assert copies is not None and copies.joint.shape[1] > 3  # cut at segment edges
    events = [0xE0 + i for i in range(spec.num_layers)] if per_layer else [0xEE]
    got = FakeRuntime()
    buffers = run_buffers(host, dev)
    assert buffers is not None
    run_layers(got.native(lib), copies, buffers, Direction(direction), 5, 9, 0xF0, events)
    assert got.calls == expected_calls(joint_of(copies), host, dev, Direction(direction), events, small)
    assert sum(c[0] == "record" for c in got.calls) == len(events) + 1


@needs_cc
def test_run_layers_refuses_copies_and_buffers_of_other_pools(lib, pin) -> None:
    """Raw addresses of one pool pair never serve runs planned for another: refused before any call."""
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev).copies(64, ([(0, 64)], [(64, 64)]))
    events = list(range(1, spec.num_layers + 1))
    for other in (run_buffers(HostPool(spec, 256), dev), run_buffers(host, DevicePool(spec, 256))):
        rt = FakeRuntime()
        with pytest.raises(PlanError, match="planned for"):
            run_layers(rt.native(lib), copies, other, Direction.LOAD, 5, 9, 0xF0, events)
        assert rt.calls == []


@needs_cc
def test_run_layers_names_the_failing_layer_and_stops(lib, pin) -> None:
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev).copies(64, ([(0, 64)], [(64, 64)]))
    buffers = run_buffers(host, dev)
    events = list(range(1, spec.num_layers + 1))
    assert len(events) == 3
    rt = FakeRuntime(fail_at=2 + 2 * 2)  # order record, wait, then (copy, record) per layer: layer 2's copy
    with pytest.raises(CudaRuntimeError, match="at layer 2: CUDA error 700"):
        run_layers(rt.native(lib), copies, buffers, Direction.LOAD, 5, 9, 0xF0, events)
    assert len(rt.calls) == 7
    rt = FakeRuntime(fail_at=1)
    with pytest.raises(CudaRuntimeError, match="ordering after the compute stream"):
        run_layers(rt.native(lib), copies, buffers, Direction.LOAD, 5, 9, 0xF0, events)
    with pytest.raises(ValueError, match="2 events for 3 layers"):
        run_layers(FakeRuntime().native(lib), copies, buffers, Direction.LOAD, 5, 9, 0xF0, events[:2])


@needs_cc
def test_a_batch_the_runtime_lacks_fails_before_any_call(lib, pin) -> None:
    """The loop's own check (behind the Python one): nothing submitted, not even the ordering."""
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev, force="copy").copies(64, ([(0, 32), (128, 32)], [(0, 64)]))
    rt = FakeRuntime(batch=False)
    loop = rt.native(lib)
    loop.has_batch = True  # past the Python check, into the C one
    events = list(range(1, spec.num_layers + 1))
    with pytest.raises(CudaRuntimeError, match="before any call: the runs need the batched copy call"):
        loop.copy_layers(copies.joint[1:], run_buffers(host, dev), True, events, 5, (0xF0, 9), small=1)
    assert rt.calls == []


@needs_cc
def test_the_loop_does_not_take_runs_that_fan_out_or_need_a_missing_batch_call(lib, pin) -> None:
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP, small_batch=2))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 4096), DevicePool(spec, 4096)
    runs = ([(i * 64, 32) for i in range(20)], [(0, 640)])
    copies = raw_planner(host, dev, force="copy").copies(640, runs)
    # Runs of 1.5 KB, short: the planner fans them out over its copy streams, which the loop does not.
    assert copies.streams == PathCosts().copy_streams
    with_batch, without = FakeRuntime().native(lib), FakeRuntime(batch=False).native(lib)
    assert not loop_takes(with_batch, copies)
    one = raw_planner(host, dev, force="copy", costs=PathCosts(copy_streams=1)).copies(640, runs)
    assert one.streams == 1
    assert loop_takes(with_batch, one) and not loop_takes(without, one)
    fanned = dataclasses.replace(one, streams=4)
    assert not loop_takes(with_batch, fanned)
    few = raw_planner(host, dev, force="copy").copies(64, ([(0, 32), (64, 32)], [(0, 64)]))
    assert loop_takes(without, dataclasses.replace(few, streams=4))  # plain copies: one stream


class _Done(Signal):
    def query(self) -> bool:
        return True

    def wait_host(self) -> None:
        pass

    def make_current_wait(self) -> None:
        pass


class _LoopLane(DeferredLane):
    """A CPU lane with a stand-in stream (5) whose compiled submissions go to a fake runtime.

    The current stream is 9, the ordering event 0xF0 and the signals' events 0xE0 + i; nothing
    moves, and every signal reads as done."""

    stream = SimpleNamespace(cuda_stream=5)

    def run_native(self, submit, signals: int):
        submit(9, 0xF0, [0xE0 + i for i in range(signals)])
        return [_Done() for _ in range(signals)]


def loop_cache(dev: DevicePool, host: HostPool, config: CacheConfig, loop: native.Native) -> CacheController:
    """A cache whose transfers go out from `loop` (a stand-in runtime's) on stand-in lanes."""
    mover = DeviceHostMover(
        dev, host, costs=config.costs, force=config.force_path, lanes=(_LoopLane(), _LoopLane()), loop=loop
    )
    mover.transfers.planner.batched = True  # raw copies, as `raw_planner`'s
    return CacheController(dev, host, config, mover=mover)


@needs_cc
def test_a_reload_from_runs_goes_out_from_the_loop_with_the_calls_of_its_plan(lib, monkeypatch, pin) -> None:
    """The cache's reload of nodes whose runs it knows: one loop call making the calls of its runs
    (the plan built only when asked for); a failing call leaves the tree as it was."""
    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP))
    spec = preset("tiny-dsa", 2)
    rt = FakeRuntime()
    c = loop_cache(DevicePool(spec, 64), HostPool(spec, 64), CacheConfig(), rt.native(lib))
    tokens = tuple(range(16))
    c.insert(tokens, c.alloc_device(16))
    c.insert((*range(8), 99, 99), torch.cat([c.match(tokens).device_slots[:8], c.alloc_device(2)]))
    c.flush()
    c.evict_device(64)
    assert rt.calls  # the backups went out from the loop too
    rt.calls.clear()
    built = []
    build = Planner.plan_allocated
    monkeypatch.setattr(Planner, "plan_allocated", lambda *a, **k: built.append(1) or build(*a, **k))

    m = c.match(tokens)
    assert len(m.host_nodes) == 2  # split after 8 tokens: two nodes, host runs from both
    h = c.load_back(m)
    assert built == []  # submitted from the runs alone
    assert h.plan is not None and h.plan.path is TransferPath.COPY and built
    events = [0xE0 + i for i in range(spec.num_layers)]
    (part,) = h.plan.parts
    runs = list(
        zip(part.runs.host.tolist(), part.runs.device.tolist(), part.runs.length.tolist(), strict=True)
    )
    assert rt.calls == expected_calls(
        runs, c.host_pool, c.device_pool, Direction.LOAD, events, dma.small_batch()
    )
    c.poll()
    c.check_invariants(compare_bytes=False)  # the stand-in runtime moved nothing

    c.evict_device(64)
    before = (c.device_alloc.available(), c.host_alloc.available())
    rt.calls.clear()
    rt.fail_at = 3
    m = c.match(tokens)
    with pytest.raises(CudaRuntimeError, match="layer 0"):
        c.load_back(m)
    assert all(n.state is NodeState.HOST and n.lock == 0 for n in m.host_nodes)
    assert (c.device_alloc.available(), c.host_alloc.available()) == before
    c.check_invariants(compare_bytes=False)


@needs_cc
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("host_runs", [1, 5])
def test_reloads_through_the_loop_are_byte_identical(lib, layout, host_runs, pin) -> None:
    """The loop's own address arithmetic against the bytes: CPU pools, a runtime whose copies move
    memory; a DSA spec over several host regions, prefixes in one or several host runs (plain
    and batched calls), two nodes, several trips; the device poisoned before every reload."""
    from conftest import random_rows

    from kvtier.pool.rows import as_words

    pin(dma.RUNTIME, dma.DmaRuntime(dma.DmaMode.LOOP, small_batch=2))
    spec = preset("tiny-dsa", 4)
    run_len = 320 // host_runs  # the prefix's host copy: `host_runs` runs of `run_len` slots
    # Room for the prefix in exactly those runs, the gaps between them, and 4 slots more.
    host = HostPool(spec, run_len * host_runs + 4 * host_runs, layout, chunk_bytes=8 << 10)
    assert host.num_segments() > 1
    # Copy-engine plans forced: without a GPU the planner may pick the reference path for runs this short.
    rt = FakeRuntime(move=True)
    # One copy stream: short runs fanned out over several would not go out from the loop.
    config = CacheConfig(force_path="copy", costs=PathCosts(copy_streams=1))
    c = loop_cache(DevicePool(spec, 512), host, config, rt.native(lib))
    held, runs_held = [], []
    for i in range(host_runs):  # the prefix's future runs, each but the last followed by 4 held slots
        runs_held.append(c.host_alloc.alloc(run_len))
        if i < host_runs - 1:
            held.append(c.host_alloc.alloc(4))
    for p in runs_held:
        c.host_alloc.free(p)
    gen = torch.Generator().manual_seed(1)
    tokens = tuple(range(run_len * host_runs))
    slots = c.alloc_device(len(tokens))
    want = {}
    for b in spec.buffers:
        for layer in b.layers:
            rows = random_rows(len(slots), b, gen)
            c.device_pool.layer(b.name, layer)[slots] = rows
            want[b.name, layer] = as_words(rows).clone()
    c.insert(tokens, slots)
    c.insert((*tokens[:64], 7, 7, 7, 7), torch.cat([slots[:64], c.alloc_device(4)]))  # splits at 64
    c.flush()
    for _ in range(3):
        c.evict_device(512)
        poison_device(c.device_pool, gen)
        m = c.match(tokens)
        assert len(m.host_nodes) == 2 and sum(len(n.host_runs) for n in m.host_nodes) >= host_runs
        rt.calls.clear()
        h = c.load_back(m)
        assert rt.calls and h.plan is not None  # through the loop
        c.poll()
        for (name, layer), rows in want.items():
            got = as_words(c.device_pool.layer(name, layer))[h.device_slots]
            assert same_bytes(got, rows), (name, layer)
    for slots in held:  # the test's own: every other slot is free or a node's
        c.host_alloc.free(slots)
    c.check_invariants()


def test_a_planner_without_raw_copies_plans_none_for_the_loop() -> None:
    """Torch copies (a CPU pool, or no raw runtime) never go out from the loop: `copies` is None, while
    the same runs with raw copies are one copy each; a plan whose rows some other mechanism moves is
    None either way."""
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    runs = ([(0, 32), (128, 32)], [(0, 64)])
    assert Planner(host, dev, force="copy").copies(64, runs) is None
    copies = raw_planner(host, dev, force="copy").copies(64, runs)
    assert copies is not None and joint_of(copies) == [(0, 0, 32), (128, 32, 32)]
    assert raw_planner(host, dev, force="reference").copies(64, runs) is None
    with pytest.raises(PlanError, match="the plan has"):
        raw_planner(host, dev).copies(60, runs)
