"""The compiled submission loop: its calls against a model made from tensor views, with stand-in
runtime functions."""

from __future__ import annotations

import ctypes
import shutil
import threading
from collections.abc import Callable
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
from kvtier.transfer import PathCosts, TransferPath, cudart, kernels, native
from kvtier.transfer.compiled import CompiledLaunch
from kvtier.transfer.cudart import MEMCPY_DEFAULT
from kvtier.transfer.lanes import DeferredLane, EventSignals, Signal
from kvtier.transfer.loop import copies_work, run_buffers, run_work
from kvtier.transfer.parts import KernelPart
from kvtier.transfer.plan import Planner

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler"
)

VP, SZ, UI = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
COPY_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, SZ, ctypes.c_int, VP)
BATCH_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, VP, SZ, VP, VP, SZ, VP)
RECORD_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP)
WAIT_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, VP, ctypes.c_uint)
LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int, VP, UI, UI, UI, UI, UI, UI, UI, VP, VP, VP)
ATTRS = 0xA77
FUNC = 0xC000  # the stand-in kernels' handles: FUNC + i for the i-th launch shape found


def _int64s(address: int, n: int) -> list[int]:
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_int64)), (n,)).tolist()


class FakeRuntime:
    """Runtime entry points that log their calls; `fail_at`: the call (0-based) that returns 700;
    `move`: copies and kernel launches move their bytes at once (for pools in CPU memory), records
    and waits do nothing. Kernel launches are logged as `("launch", func, grid, threads, shared,
    stream, src, src offsets, dst, dst offsets, n, row vectors, null pointers)`."""

    def __init__(self, fail_at: int | None = None, batch: bool = True, move: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail_at = fail_at
        self.shapes: list = []  # the RowLaunch of each stand-in kernel, by FUNC + index
        self.before: Callable[[tuple], None] | None = None  # called with each call, before it is logged

        def log(*call) -> int:
            if self.before is not None:
                self.before(call)
            self.calls.append(call)
            if move and call[0] == "copy":  # CPU pools: every address is in this process's memory
                ctypes.memmove(call[1], call[2], call[3])
            elif move and call[0] == "batch":
                for dst, src, n in zip(*call[1:4], strict=True):
                    ctypes.memmove(dst, src, n)
            elif move and call[0] == "launch":
                self._rows(*call[1:])
            return 700 if len(self.calls) - 1 == self.fail_at else 0

        def batch_call(dsts, srcs, sizes, count, attrs, idx, nattrs, stream) -> int:
            read = [_int64s(p, count) for p in (dsts, srcs, sizes)]
            index = ctypes.cast(idx, ctypes.POINTER(ctypes.c_size_t))[0]
            return log("batch", *read, count, attrs, index, nattrs, stream)

        def launch_call(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
            p = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            found = self.found[func - FUNC]
            words = [ctypes.cast(p[i], ctypes.POINTER(ctypes.c_int64))[0] for i in range(4)]
            n = ctypes.cast(p[4], ctypes.POINTER(ctypes.c_int32))[0]
            vecs = ctypes.cast(p[5], ctypes.POINTER(ctypes.c_int32))[0]
            nulls = [ctypes.cast(p[6 + i], ctypes.POINTER(ctypes.c_void_p))[0] for i in range(found.extra)]
            assert (gy, gz, by, bz, extra) == (1, 1, 1, 1, None)
            return log("launch", func, gx, bx, shared, stream, *words, n, vecs, nulls)

        # Kept on the object: the loop calls them through raw pointers.
        self.fns = (
            COPY_T(lambda d, s, n, kind, st: log("copy", d, s, n, kind, st)),
            BATCH_T(batch_call) if batch else None,
            RECORD_T(lambda e, st: log("record", e, st)),
            WAIT_T(lambda st, e, flags: log("wait", st, e, flags)),
            LAUNCH_T(launch_call),
        )
        self.found: list[CompiledLaunch] = []

    def find(self, launch, views, aligned) -> CompiledLaunch:
        """The stand-in for `compiled.find`: a kernel handle per launch shape, 32-bit ints, two nulls."""
        self.shapes.append(launch)
        self.found.append(CompiledLaunch(FUNC + len(self.found), 128, 0, 4, 4, 2))
        return self.found[-1]

    def _rows(self, func, grid, threads, shared, stream, src, src_off, dst, dst_off, n, vecs, nulls) -> None:
        """What the kernel does: `n` units of `row_vecs` vectors at word offsets (`RowLaunch`)."""
        shape = self.shapes[func - FUNC].shape
        word = shape.word
        unit = vecs * shape.kwargs["VEC"] * word
        for s, d in zip(_int64s(src_off, n), _int64s(dst_off, n), strict=True):
            ctypes.memmove(dst + d * word, src + s * word, unit)

    def native(self, lib: ctypes.CDLL) -> native.Native:
        addr = [ctypes.cast(f, ctypes.c_void_p).value if f is not None else 0 for f in self.fns]
        loop = native.Native(lib, *addr[:4], attrs=ATTRS, launch=addr[4], kernel=self.find)
        loop.keep_alive = self  # type: ignore[attr-defined]  # the loop calls into self.fns
        return loop


def submit(loop, work, buffers, direction, events, streams=(5,), forks=None) -> None:
    """`run_work` as a lane calls it: current stream 9, ordering event 0xF0, forks 0xF1 + i."""
    forks = forks or [0xF1 + i for i in range(len(streams))]
    run_work(loop, work, buffers, Direction(direction), 9, 0xF0, events, list(streams), forks)


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


def expected_calls(runs, host, dev, direction, events, small, streams=(5,), order=0xF0, current=9) -> list:
    """The calls the loop must make for joint runs `(first host slot, first device slot, length)` on
    `streams` (forks 0xF1 + i): the ordering record and wait, the side streams' fork, then per layer
    (on streams[layer % k]) each buffer's copies (one call per run, or one batch above `small` runs)
    and the layer's event, then the join and the last event on the first stream. Addresses from
    tensor views of the pools, not from the plan's byte tables."""
    spec = host.spec
    seg = host.segment_slots
    k, main = len(streams), streams[0]
    forks = [0xF1 + i for i in range(k)]
    calls = [("record", order, current), ("wait", main, order, 0)]
    if k > 1:
        calls += [("record", forks[0], main)] + [("wait", s, forks[0], 0) for s in streams[1:]]
    for layer in range(spec.num_layers):
        stream = streams[layer % k]
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
        if len(events) == spec.num_layers and (k == 1 or layer < spec.num_layers - 1):
            calls.append(("record", events[layer], stream))
    for s, fork in zip(streams[1:], forks[1:], strict=True):
        calls += [("record", fork, s), ("wait", main, fork, 0)]
    if k > 1 or len(events) != spec.num_layers:
        calls.append(("record", events[-1], main))
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
@pytest.mark.parametrize("streams", [(5,), (5, 6, 7)])
def test_the_loop_makes_the_calls_of_its_runs(lib, small, layout, direction, per_layer, streams, pin):
    """Addresses computed in the loop against tensor views of the same rows: the same calls, in order.

    A DSA spec (the indexer on some layers only), both host layouts (page-first cuts runs at
    every page), host runs over several regions (a small chunk size), batched and plain calls,
    one stream or three (layer l on the l-th, forked from and joined into the first).
    """
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP, small_batch=small))
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
    submit(got.native(lib), copies_work(copies, buffers), buffers, direction, events, streams)
    want = expected_calls(joint_of(copies), host, dev, Direction(direction), events, small, streams)
    assert got.calls == want
    forks = len(streams) if len(streams) > 1 else 0  # the fork and a join per side stream
    assert sum(c[0] == "record" for c in got.calls) == len(events) + 1 + forks


@needs_cc
def test_the_loop_refuses_work_and_buffers_of_other_pools(lib, pin) -> None:
    """Raw addresses of one pool pair never serve runs planned for another: refused before any call."""
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev).copies(64, ([(0, 64)], [(64, 64)]))
    for other in (run_buffers(HostPool(spec, 256), dev), run_buffers(host, DevicePool(spec, 256))):
        with pytest.raises(PlanError, match="planned for"):
            copies_work(copies, other)


@needs_cc
def test_the_loop_names_the_failing_layer_and_stops(lib, pin) -> None:
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev).copies(64, ([(0, 64)], [(64, 64)]))
    buffers = run_buffers(host, dev)
    work = copies_work(copies, buffers)
    events = list(range(1, spec.num_layers + 1))
    assert len(events) == 3
    rt = FakeRuntime(fail_at=2 + 2 * 2)  # order record, wait, then (copy, record) per layer: layer 2's copy
    with pytest.raises(CudaRuntimeError, match="at layer 2: CUDA error 700"):
        submit(rt.native(lib), work, buffers, "load", events)
    assert len(rt.calls) == 7
    rt = FakeRuntime(fail_at=1)
    with pytest.raises(CudaRuntimeError, match="ordering after the compute stream"):
        submit(rt.native(lib), work, buffers, "load", events)
    # Two streams: order (2), fork (2), three layers' copies and the first two records (5), the join
    rt = FakeRuntime(fail_at=10)
    with pytest.raises(CudaRuntimeError, match="joining its streams"):
        submit(rt.native(lib), work, buffers, "load", events, (5, 6))
    with pytest.raises(ValueError, match="2 events for 3 layers"):
        submit(FakeRuntime().native(lib), work, buffers, "load", events[:2])
    with pytest.raises(ValueError, match="2 streams need as many fork events"):
        submit(FakeRuntime().native(lib), work, buffers, "load", events, (5, 6), [0xF1])


@needs_cc
def test_a_job_makes_the_same_calls_from_its_own_thread_and_says_which_events_are_recorded(lib, pin) -> None:
    """`run_work(device=...)`: the calls of the inline loop, made from another thread after it set the
    device; signal i reads as recorded once layer i's event is (the last once the loop is done),
    without or with a wait; the job is held in `RUNNING` until finished."""
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
    spec = preset("tiny-dsa", 4)
    host, dev = HostPool(spec, 1024), DevicePool(spec, 512)
    copies = raw_planner(host, dev, force="copy").copies(96, ([(40, 80), (300, 16)], [(0, 96)]))
    buffers = run_buffers(host, dev)
    events = [0xE0 + i for i in range(spec.num_layers)]
    rt, threads, held = FakeRuntime(), set(), threading.Event()

    def before(call) -> None:
        threads.add(threading.get_ident())
        if call[:2] == ("record", events[1]):
            assert held.wait(10)

    rt.before = before
    devices: list[int] = []
    set_device = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda d: devices.append(d) or 0)
    addr = [ctypes.cast(f, ctypes.c_void_p).value for f in (*rt.fns[:4], set_device)]
    loop = native.Native(lib, *addr[:4], attrs=ATTRS, set_device=addr[4])
    job = run_work(
        loop, copies_work(copies, buffers), buffers, Direction.LOAD, 9, 0xF0, events, [5], [0xF1], 3
    )
    assert job in native.RUNNING
    assert job.recorded(0, wait=True)
    assert not job.recorded(1) and not job.recorded(spec.num_layers - 1)  # held before layer 1's record
    held.set()
    assert job.recorded(spec.num_layers - 1, wait=True) and job.recorded(1)
    assert job.finish() is None and job not in native.RUNNING and job.keep == []
    assert devices == [3] and threads and threading.get_ident() not in threads
    assert rt.calls == expected_calls(
        joint_of(copies), host, dev, Direction.LOAD, events, cudart.small_batch(), (5,)
    )


def test_signals_of_a_job_wait_for_their_own_record_whatever_the_index() -> None:
    """`EventSignals` of a job: signal i (also as a negative index) asks the job for record i first."""
    asked = []

    class Job:
        def recorded(self, i: int, wait: bool = False) -> bool:
            asked.append((i, wait))
            return i < 2

    events = [SimpleNamespace(query=lambda: True, synchronize=lambda: None) for _ in range(4)]
    signals = EventSignals(events, [], Job())  # type: ignore[arg-type]
    assert signals[1].query() and not signals[-1].query() and not signals[-2].query()
    signals[-1].wait_host()
    assert asked == [(1, False), (3, False), (2, False), (3, True)]
    assert signals[-1] is signals[3]


@needs_cc
def test_a_job_that_fails_raises_from_its_signals_and_logs_once(lib, pin, caplog) -> None:
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    buffers = run_buffers(host, dev)
    work = copies_work(raw_planner(host, dev).copies(64, ([(0, 64)], [(64, 64)])), buffers)
    events = list(range(1, spec.num_layers + 1))
    rt = FakeRuntime(fail_at=2 + 2 * 2)  # order record, wait, then (copy, record) per layer: layer 2's copy
    job = run_work(rt.native(lib), work, buffers, Direction.LOAD, 9, 0xF0, events, [5], [0xF1], 0)
    with pytest.raises(CudaRuntimeError, match="at layer 2: CUDA error 700"):
        job.recorded(spec.num_layers - 1, wait=True)
    with pytest.raises(CudaRuntimeError, match="at layer 2"):
        job.recorded(0)  # every signal of a failed job
    assert isinstance(job.finish(), CudaRuntimeError) and len(rt.calls) == 7
    assert [r.levelname for r in caplog.records if "own thread failed" in r.message] == ["ERROR"]
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda d: 101)
    rt = FakeRuntime()
    addr = [ctypes.cast(f, ctypes.c_void_p).value for f in (*rt.fns[:4], failing)]
    loop = native.Native(lib, *addr[:4], attrs=ATTRS, set_device=addr[4])
    job = run_work(loop, work, buffers, Direction.LOAD, 9, 0xF0, events, [5], [0xF1], 1)
    assert "setting the device of its thread: CUDA error 101" in str(job.finish()) and rt.calls == []


@needs_cc
def test_a_call_the_runtime_lacks_fails_before_any_call(lib, pin) -> None:
    """The loop's own checks (behind the Python ones): nothing submitted, not even the ordering."""
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP, small_batch=1))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 256), DevicePool(spec, 256)
    copies = raw_planner(host, dev, force="copy").copies(64, ([(0, 32), (128, 32)], [(0, 64)]))
    buffers = run_buffers(host, dev)
    rt = FakeRuntime(batch=False)
    loop = rt.native(lib)
    events = list(range(1, spec.num_layers + 1))
    work = copies_work(copies, buffers)
    assert not work.takes(loop)  # the Python check; past it, into the C one
    with pytest.raises(CudaRuntimeError, match="before any call: the runs need the batched copy call"):
        submit(loop, work, buffers, "load", events)
    work.rows[0].launches = 0xDEAD  # a launch, and a loop bound without the launch call
    bare = native.Native(lib, *(ctypes.cast(f, ctypes.c_void_p).value for f in rt.fns[:4]), attrs=ATTRS)
    with pytest.raises(CudaRuntimeError, match="before any call: the work has kernel launches"):
        submit(bare, work, buffers, "load", events)
    assert rt.calls == []


@needs_cc
def test_short_runs_fan_out_over_layers_and_a_missing_batch_call_is_seen(lib, pin) -> None:
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP, small_batch=2))
    spec = preset("tiny-mla", 4)
    host, dev = HostPool(spec, 4096), DevicePool(spec, 4096)
    runs = ([(i * 64, 32) for i in range(20)], [(0, 640)])
    copies = raw_planner(host, dev, force="copy").copies(640, runs)
    # Runs of 1.5 KB, short: the planner spreads them over its copy streams, a layer on each.
    assert copies.streams == PathCosts().copy_streams
    buffers = run_buffers(host, dev)
    with_batch, without = FakeRuntime().native(lib), FakeRuntime(batch=False).native(lib)
    work = copies_work(copies, buffers)
    assert work.streams == copies.streams and work.takes(with_batch) and not work.takes(without)
    few = raw_planner(host, dev, force="copy").copies(64, ([(0, 32), (64, 32)], [(0, 64)]))
    assert copies_work(few, buffers).takes(without)  # plain copies


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

    def run_native(self, submit, signals: int, streams: int = 1, off_thread: bool = False):
        handles = [5, *(0x50 + i for i in range(1, streams))]
        submit(9, 0xF0, [0xE0 + i for i in range(signals)], handles, [0xF1 + i for i in range(streams)], None)
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
    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP))
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
    streams = (5, *(0x50 + i for i in range(1, part.streams)))  # `_LoopLane`'s
    assert rt.calls == expected_calls(
        runs, c.host_pool, c.device_pool, Direction.LOAD, events, cudart.small_batch(), streams
    )
    c.poll()
    c.check_invariants(compare_bytes=False)  # the stand-in runtime moved nothing

    c.evict_device(64)
    before = (c.device_alloc.available(), c.host_alloc.available())
    rt.calls.clear()
    rt.fail_at = 2 + (part.streams if part.streams > 1 else 0)  # layer 0's first copy, after the fork
    m = c.match(tokens)
    with pytest.raises(CudaRuntimeError, match="layer 0"):
        c.load_back(m)
    assert all(n.state is NodeState.HOST and n.lock == 0 for n in m.host_nodes)
    assert (c.device_alloc.available(), c.host_alloc.available()) == before
    c.check_invariants(compare_bytes=False)


@needs_cc
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("host_runs", [1, 5])
@pytest.mark.parametrize("force", ["copy", "kernel", None])
def test_reloads_through_the_loop_are_byte_identical(lib, layout, host_runs, force, pin) -> None:
    """The loop's own address arithmetic against the bytes: CPU pools, a runtime whose copies and
    kernel launches move memory; a DSA spec over several host regions, prefixes in one or several
    host runs (plain and batched calls, copies over several streams), the kernel forced or the
    planner's choice, two nodes, several trips; the device poisoned before every reload."""
    from conftest import random_rows

    from kvtier.pool.rows import as_words

    pin(cudart.DMA, cudart.DmaRuntime(cudart.DmaMode.LOOP, small_batch=2))
    spec = preset("tiny-dsa", 4)
    run_len = 320 // host_runs  # the prefix's host copy: `host_runs` runs of `run_len` slots
    # Room for the prefix in exactly those runs, the gaps between them, and 4 slots more.
    host = HostPool(spec, run_len * host_runs + 4 * host_runs, layout, chunk_bytes=8 << 10)
    assert host.num_segments() > 1
    if force != "copy" and not kernels.runs_on(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    rt = FakeRuntime(move=True)
    c = loop_cache(DevicePool(spec, 512), host, CacheConfig(force_path=force), rt.native(lib))
    c.mover.transfers.planner.kernel_ok = force != "copy"  # as on CUDA
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
        kernel_parts = any(isinstance(p, KernelPart) for p in h.plan.parts)
        assert kernel_parts == any(call[0] == "launch" for call in rt.calls)
        assert kernel_parts or force != "kernel"
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
