"""The cache controller's behaviours one at a time: policies, splits, loads, bad calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.cache import CacheConfig, CacheController, DeviceHostMover, Mover, NodeState, WritePolicy
from kvtier.errors import (
    CacheFullError,
    CacheStateError,
    ClosedError,
    ConfigError,
    CudaRuntimeError,
    LeaseError,
    SlotError,
)
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.rows import as_words
from kvtier.spec import preset
from kvtier.transfer import TransferPath, kernels


def make(policy=WritePolicy.WRITE_THROUGH, device=32, host=64, ps=2, mover=None, **kw) -> CacheController:
    spec = preset("tiny-dsa", ps)
    dev, host_pool = DevicePool(spec, device), HostPool(spec, host)
    return CacheController(
        dev, host_pool, CacheConfig(write_policy=policy, **kw), mover=mover(dev, host_pool) if mover else None
    )


class FlakyMover(Mover):
    """The real device <-> host mover, made to fail at submission while `fail` is set."""

    def __init__(self, dev: DevicePool, host: HostPool) -> None:
        self.inner = DeviceHostMover(dev, host)
        self.fail = False

    def submit(self, op):
        if self.fail:
            raise CudaRuntimeError("submission failed")
        return self.inner.submit(op)

    def drain(self) -> None:
        self.inner.drain()


def fill(c: CacheController, tokens: tuple[int, ...]) -> torch.Tensor:
    """A request that computes all of `tokens`: fresh slots with random KV, inserted; returns the slots."""
    m = c.match(tokens)
    lease = c.acquire(m)
    new = c.alloc_device(len(tokens) - m.device_tokens)
    gen = torch.Generator().manual_seed(len(tokens))
    for b in c.spec.buffers:
        for layer in b.layers:
            w = as_words(c.device_pool.layer(b.name, layer))
            data = torch.randint(-(2**30), 2**30, (len(new), w.shape[1]), generator=gen).to(w.dtype)
            w[new.to(w.device)] = data.to(w.device)
    slots = torch.cat([m.device_slots, new])
    c.insert(tokens, slots)
    c.release(lease)
    return slots


def rows(c: CacheController, slots: torch.Tensor, layer: int = 0) -> torch.Tensor:
    w = as_words(c.device_pool.layer("kv", layer))
    return w[slots.to(w.device)].cpu()


def test_write_through_backs_up_at_insert_and_completes_on_its_signal() -> None:
    c = make(WritePolicy.WRITE_THROUGH)
    fill(c, tuple(range(8)))
    (node,) = c.tree.root.children.values()
    assert node.state is NodeState.BACKING_UP  # the copy is queued, not done
    c.check_invariants()
    c.flush()
    assert node.state is NodeState.BOTH
    c.check_invariants()  # host bytes equal device bytes
    assert c.metrics.backups == 1 and c.metrics.bytes_d2h == 8 * c.spec.bytes_per_token()


def test_selective_backs_up_after_enough_hits() -> None:
    c = make(WritePolicy.WRITE_THROUGH_SELECTIVE, selective_hits=3)
    tokens = tuple(range(8))
    fill(c, tokens)  # its match counted no hit on the new node
    (node,) = c.tree.root.children.values()
    c.match(tokens)
    assert node.state is NodeState.DEVICE
    c.match(tokens)
    c.match(tokens)
    assert node.state is NodeState.BACKING_UP


def test_write_back_copies_only_on_eviction() -> None:
    c = make(WritePolicy.WRITE_BACK)
    tokens = tuple(range(8))
    slots = fill(c, tokens)
    want = rows(c, slots)
    (node,) = c.tree.root.children.values()
    assert node.state is NodeState.DEVICE and c.metrics.backups == 0
    assert c.evict_device(8) == 8
    assert node.state is NodeState.HOST and c.metrics.backups == 1
    m = c.match(tokens)
    assert m.device_tokens == 0 and m.host_tokens == 8
    h = c.load_back(m)
    h.wait()
    assert torch.equal(rows(c, h.device_slots), want)
    c.flush()
    c.check_invariants()


def test_split_keeps_slot_ownership_exact() -> None:
    c = make()
    a = fill(c, (1, 1, 2, 2, 3, 3, 4, 4))
    b = fill(c, (1, 1, 2, 2, 9, 9))
    c.flush()
    c.check_invariants()
    head = c.tree.root.children[(1, 1)]
    assert head.key.tolist() == [1, 1, 2, 2] and set(head.children) == {(3, 3), (9, 9)}
    assert torch.equal(head.device_slots, a[:4]) and torch.equal(b[:4], a[:4])
    assert torch.equal(head.children[(3, 3)].device_slots, a[4:])
    assert torch.equal(head.children[(9, 9)].device_slots, b[4:])


def test_layerwise_readiness_without_a_host_sync() -> None:
    """After `wait_layer(0)` layer 0 is in place while later layers are still queued."""
    c = make(WritePolicy.WRITE_THROUGH)
    tokens = tuple(range(8))
    slots = fill(c, tokens)
    want = [rows(c, slots, layer) for layer in range(c.spec.num_layers)]
    c.flush()
    c.evict_device(8)
    for layer in range(c.spec.num_layers):  # poison the device
        w = as_words(c.device_pool.layer("kv", layer))
        w.copy_(~w)
    m = c.match(tokens)
    h = c.load_back(m)
    h.wait_layer(0)
    assert torch.equal(rows(c, h.device_slots, 0), want[0])
    assert not torch.equal(rows(c, h.device_slots, 2), want[2])
    h.wait_layer(2)
    assert torch.equal(rows(c, h.device_slots, 2), want[2])
    c.poll()
    assert all(n.state is NodeState.BOTH for n in h.nodes)


def test_short_host_hits_are_recomputed() -> None:
    c = make(recompute_below=6)
    fill(c, (5, 5, 6, 6))
    c.flush()
    c.evict_device(4)
    m = c.match((5, 5, 6, 6))
    h = c.load_back(m)
    assert h.recompute and h.tokens == 4 and len(h.device_slots) == 0
    assert c.metrics.recomputed_tokens == 4 and c.metrics.loads == 0
    # The request recomputes the tokens; inserting them takes the fresh slots and drops the host copy.
    new = c.alloc_device(4)
    c.insert((5, 5, 6, 6), new)
    node = c.tree.root.children[(5, 5)]
    assert node.state in (NodeState.BACKING_UP, NodeState.DEVICE) and torch.equal(node.device_slots, new)
    c.flush()
    c.check_invariants()


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_keys_keep_the_callers_int32_or_int64_ids_and_match_either(dtype) -> None:
    """int32 keys hold half the bytes; ids of the other width still match exactly (cast as compared)."""
    c = make()
    ids = np.arange(100, 108).astype(dtype)
    fill(c, ids)
    (node,) = c.match(ids).device_nodes
    assert node.key.dtype == (np.int32 if dtype is np.int32 else np.int64)
    for other in (np.int32, np.int64):
        m = c.match(np.append(ids, 5).astype(other))
        assert m.tokens == 8 and m.device_nodes == [node]
    ids_off = ids.astype(np.int64)
    ids_off[5] += 2**32  # equal to the key's id modulo 2**32: must not match as int32
    assert c.match(ids_off).tokens == 4
    c.check_invariants()


def test_a_transfer_that_fails_to_submit_leaves_the_cache_as_it_was() -> None:
    """A runtime error while a load or backup is submitted: slots back, locks undone, nothing lost."""
    c = make(mover=FlakyMover)
    tokens = tuple(range(8))
    slots = fill(c, tokens)
    want = {
        (b.name, lay): as_words(c.device_pool.layer(b.name, lay))[slots].clone()
        for b in c.spec.buffers
        for lay in b.layers
    }
    c.flush()
    c.evict_device(8)
    before = (c.device_alloc.available(), c.host_alloc.available())
    c.mover.fail = True
    m = c.match(tokens)
    with pytest.raises(CudaRuntimeError, match="submission failed"):
        c.load_back(m)
    assert all(n.state is NodeState.HOST and n.lock == 0 for n in m.host_nodes)
    assert (c.device_alloc.available(), c.host_alloc.available()) == before
    c.check_invariants()
    # A backup that fails: the inserted node stays on the device only, its host slots come back.
    with pytest.raises(CudaRuntimeError, match="submission failed"):
        fill(c, tuple(range(100, 108)))
    (node,) = c.match(tuple(range(100, 108))).device_nodes
    assert node.state is NodeState.DEVICE and node.host_slots is None
    assert c.host_alloc.available() == before[1]
    c.check_invariants()
    assert c.metrics.failed_submissions == 2
    c.mover.fail = False
    h = c.load_back(c.match(tokens))  # the same load goes through once submission works
    h.wait()
    for (name, lay), rows in want.items():
        assert torch.equal(as_words(c.device_pool.layer(name, lay))[h.device_slots], rows), (name, lay)
    c.check_invariants()


def test_bad_calls_raise_and_change_nothing() -> None:
    c = make()
    fill(c, tuple(range(8)))
    c.flush()
    lease = c.acquire(c.match(tuple(range(8))))
    c.release(lease)
    with pytest.raises(LeaseError):
        c.release(lease)
    snapshot = (c.device_alloc.available(), c.host_alloc.available())
    with pytest.raises(SlotError, match="not held"):
        c.insert((7, 7, 7, 7), torch.tensor([20, 21, 22, 23]))
    with pytest.raises(SlotError, match="whole number of pages"):
        c.insert((7, 7, 7), c.alloc_device(2))
    with pytest.raises(SlotError, match="not held"):
        c.free_device(torch.tensor([30]))
    with pytest.raises(SlotError, match="integer ids"):
        c.insert([7.0, 7, 7, 7], c.alloc_device(4))
    with pytest.raises(SlotError, match="1-D"):
        c.insert(torch.zeros(2, 2, dtype=torch.int64), c.alloc_device(4))
    assert c.device_alloc.available() == snapshot[0] - 10  # only the alloc_device calls above
    assert c.host_alloc.available() == snapshot[1]
    c.check_invariants()


def test_match_takes_lists_tensors_and_arrays_alike() -> None:
    c = make()
    fill(c, tuple(range(8)))
    for tokens in ([*range(8), 9], torch.arange(9), np.arange(9), np.arange(9, dtype=np.int32)):
        m = c.match(tokens)
        assert m.tokens == 8 and m.device_tokens == 8
    with pytest.raises(SlotError, match="integer ids"):
        c.match([0.5, 1.5])
    with pytest.raises(SlotError, match="1-D"):
        c.match([[0, 1]])


def test_loading_an_evicted_or_loading_node_is_refused() -> None:
    c = make()
    fill(c, tuple(range(8)))
    c.flush()
    c.evict_device(8)
    m = c.match(tuple(range(8)))
    c.evict_host(8)  # the host copy is dropped while the match is held without a lease
    with pytest.raises(CacheStateError, match="not host-only"):
        c.load_back(m)
    fill(c, tuple(range(8)))
    c.flush()
    c.evict_device(8)
    m = c.match(tuple(range(8)))
    c.load_back(m)
    with pytest.raises(CacheStateError, match="not host-only"):
        c.load_back(m)  # already loading
    c.flush()
    c.check_invariants()


def test_locked_nodes_are_not_evicted_and_a_full_device_says_so() -> None:
    c = make(device=8)
    fill(c, tuple(range(8)))
    lease = c.acquire(c.match(tuple(range(8))))
    assert c.evict_device(8) == 0
    with pytest.raises(CacheFullError, match="device slots needed"):
        c.alloc_device(2)
    c.release(lease)
    assert len(c.alloc_device(2)) == 2
    c.check_invariants()


def test_metrics_and_fragmentation() -> None:
    c = make()
    fill(c, tuple(range(8)))
    c.match((*range(8), 50, 51))
    m = c.metrics
    assert (m.device_hit_tokens, m.miss_tokens) == (8, 8 + 2)
    frag = c.fragmentation()
    assert frag["device_free_slots"] == 24 and frag["device_largest_free_run"] == 24
    assert frag["host_free_slots"] == 56


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("route", ["loop", "off_thread", "executor"])
def test_cuda_round_trip_is_byte_identical(policy, route, monkeypatch) -> None:
    """On the GPU: insert, back up, evict, load back layer by layer on the cache's streams.

    `route`: the transfers go out from the compiled loop (where it builds here), from the loop's
    own thread (every operation, however few its copies), or through the plan executor alone (a
    mover without the loop).
    """
    from kvtier.transfer import native
    from kvtier.transfer import submit as submit_module
    from kvtier.transfer.lanes import CudaLane

    submitted = []
    if route != "executor":
        if native.library() is None:
            pytest.skip("no compiled loop here")
        run_native = CudaLane.run_native
        monkeypatch.setattr(
            CudaLane, "run_native", lambda *a, **k: submitted.append(k["off_thread"]) or run_native(*a, **k)
        )
        monkeypatch.setattr(submit_module, "OFF_THREAD_S", -1.0 if route == "off_thread" else 1.0)
    spec = preset("tiny-dsa", 16)
    dev, host = DevicePool(spec, 8192, "cuda"), HostPool(spec, 8192)
    mover = DeviceHostMover(dev, host, loop=None) if route == "executor" else None
    c = CacheController(dev, host, CacheConfig(write_policy=policy), mover=mover)
    tokens = tuple(range(4096))
    slots = fill(c, tokens)
    if policy is WritePolicy.WRITE_THROUGH_SELECTIVE:  # hot enough to be kept on the host
        c.match(tokens)
        c.match(tokens)
    want = {
        (b.name, layer): as_words(c.device_pool.layer(b.name, layer))[slots.cuda()].cpu()
        for b in spec.buffers
        for layer in b.layers
    }
    c.flush()
    c.evict_device(4096)
    for b in spec.buffers:  # poison the device
        for layer in b.layers:
            w = as_words(c.device_pool.layer(b.name, layer))
            w.copy_(~w)
    m = c.match(tokens)
    assert m.host_tokens == 4096
    h = c.load_back(m)
    for layer in range(spec.num_layers):
        h.wait_layer(layer)  # the current stream waits; no host sync
    torch.cuda.current_stream().synchronize()
    for (name, layer), rows in want.items():
        got = as_words(c.device_pool.layer(name, layer))[h.device_slots.cuda()].cpu()
        assert torch.equal(got, rows), (name, layer)
    c.flush()
    c.check_invariants()
    if route != "executor":
        assert len(submitted) >= 2 and set(submitted) == {route == "off_thread"}  # the backup and the reload
        assert not native.RUNNING  # every job finished once its signals were waited for


def test_a_reload_is_planned_from_runs_without_a_pass_over_its_slots(monkeypatch) -> None:
    """Host runs kept on the nodes (through a split) and the device allocator's runs plan the load."""
    from kvtier.transfer import runs as runs_module

    c = make()
    fill(c, tuple(range(16)))
    fill(c, (*range(8), 99, 99))  # splits the first node after 8 tokens
    c.flush()
    c.evict_device(32)
    m = c.match(tuple(range(16)))
    assert len(m.host_nodes) == 2

    def no_scan(*_a, **_k):
        raise AssertionError("the slots were scanned")

    monkeypatch.setattr(runs_module, "scan", no_scan)
    h = c.load_back(m)
    assert h.plan is not None and h.plan.path is TransferPath.COPY and h.plan.joint_runs == 1
    c.flush()
    c.check_invariants()


def test_event_signals_are_made_once_and_every_event_goes_back_to_the_pool() -> None:
    """A reload's per-layer signals: one object per layer, made on first use; no event is lost."""
    import gc

    from kvtier.transfer.lanes import EventSignals

    events = [object() for _ in range(4)]  # stand-ins: nothing here touches CUDA
    pool: list[object] = []
    signals = EventSignals(events, pool)
    assert len(signals) == 4
    last = signals[-1]
    assert signals[3] is last and signals[-1] is last and last.event is events[3]
    assert [s.event for s in signals[1:3]] == events[1:3]
    del signals
    gc.collect()
    # Only the signal still held keeps its event; every other event is back (made or not).
    assert sorted(map(id, pool)) == sorted(map(id, events[:3]))
    del last
    gc.collect()
    assert sorted(map(id, pool)) == sorted(map(id, events))


@pytest.mark.skipif(not kernels.runs_on(torch.device("cpu")), reason="needs Triton's CPU interpreter")
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_kernel_reloads_land_every_layer_and_signal_per_layer(layout) -> None:
    """A reload forced onto the kernel: every layer's rows byte-identical, one signal per layer."""
    spec = preset("tiny-dsa", 1)
    c = CacheController(
        DevicePool(spec, 32),
        HostPool(spec, 64, layout),
        CacheConfig(force_path=TransferPath.KERNEL),
    )
    tokens = tuple(range(9))
    slots = fill(c, tokens)
    want = {(b.name, layer): as_words(c.device_pool.layer(b.name, layer))[slots].clone() for b in spec.buffers
            for layer in b.layers}  # fmt: skip
    c.flush()
    c.evict_device(9)
    for key in want:  # poison the device
        w = as_words(c.device_pool.layer(*key))
        w.copy_(~w)
    h = c.load_back(c.match(tokens))
    assert h.plan is not None and h.plan.path is TransferPath.KERNEL
    assert len({id(s) for s in h.layer_signals}) == len(h.layer_signals) == spec.num_layers
    for layer in range(spec.num_layers):
        h.wait_layer(layer)
    for (name, layer), rows_before in want.items():
        assert torch.equal(as_words(c.device_pool.layer(name, layer))[h.device_slots], rows_before)


@pytest.mark.parametrize(
    "bad",
    [
        {"selective_hits": 0},
        {"recompute_below": -1},
        {"eviction": "mru"},
        {"force_path": "per_run"},
        {"force_path": "staged"},
    ],
)
def test_a_bad_config_is_refused_when_made(bad) -> None:
    """Before any pool or cache is built: the config itself refuses out-of-range options."""
    with pytest.raises(ConfigError, match="cache config"):
        CacheConfig(**bad)


def test_close_completes_transfers_closes_the_pools_and_refuses_every_later_call() -> None:
    with make(WritePolicy.WRITE_THROUGH) as c:
        fill(c, tuple(range(8)))
        (node,) = c.tree.root.children.values()
        assert node.state is NodeState.BACKING_UP  # still in flight when the block ends
    assert c.closed and c.device_pool.closed and c.host_pool.closed
    assert node.state is NodeState.BOTH  # completed, not abandoned
    c.close()  # idempotent
    for call in (
        lambda: c.match((0, 1)),
        lambda: c.alloc_device(2),
        lambda: c.insert((0, 1), torch.tensor([0, 1])),
        lambda: c.evict_device(2),
        lambda: c.evict_host(2),
    ):
        with pytest.raises(ClosedError):
            call()
