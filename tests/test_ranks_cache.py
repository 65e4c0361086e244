"""Tensor-parallel ranks' caches in 2 and 4 real processes (gloo): every rank answers every call alike.

Each rank is a process with its own `CacheController` over its own pools, fed the same
calls. A rank's KV bytes are a function of the token prefix and (for K/V split by heads)
of its rank (`kv_of`), so every load is compared with that function, into destinations
poisoned first. Results come back through one pickle file per rank.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_cache_storage import kv_of

from kvtier.cache import CacheConfig, CacheController
from kvtier.cache.ranks import RankGroup
from kvtier.cache.storage_mover import open_storage
from kvtier.errors import CacheFullError, ConfigError
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint

PS = 4
MODEL = "ranks-test-model"


def rows(dev: DevicePool, name: str, layer: int) -> torch.Tensor:
    return dev.layer(name, layer).view(torch.uint8).view(dev.num_slots, -1)


def write_kv(dev: DevicePool, tokens: np.ndarray, slots: torch.Tensor, at: int, salt: int) -> None:
    for b in dev.spec.buffers:
        for layer in b.layers:
            rows(dev, b.name, layer)[slots] = kv_of(tokens, dev.spec, b.name, layer, salt)[at:]


def check_kv(dev: DevicePool, tokens: np.ndarray, slots: torch.Tensor, salt: int) -> None:
    for b in dev.spec.buffers:
        for layer in b.layers:
            want = kv_of(tokens[: len(slots)], dev.spec, b.name, layer, salt)
            assert torch.equal(rows(dev, b.name, layer)[slots], want), f"{b.name} layer {layer} differs"


def poison_free(c: CacheController, seed: int) -> None:
    """Random bytes in every free device slot: where a load lands."""
    free = torch.from_numpy(np.flatnonzero(~c.device_alloc.allocated_mask()))
    gen = torch.Generator().manual_seed(seed)
    for b in c.spec.buffers:
        for layer in b.layers:
            r = rows(c.device_pool, b.name, layer)
            r[free] = torch.randint(0, 256, (len(free), r.shape[1]), dtype=torch.uint8, generator=gen)


def compute(c: CacheController, tokens: np.ndarray, salt: int, seed: int) -> tuple[int, ...]:
    """A request: reuse what the cache holds (checked byte for byte), compute and insert the rest.

    Returns what the match and the load answered: `(tokens, device, host, storage used, loaded)`.
    """
    m = c.match(tokens)
    lease = c.acquire(m)
    poison_free(c, seed)
    h = c.load_back(m)
    h.wait()
    prefix = torch.cat([m.device_slots, h.device_slots])
    check_kv(c.device_pool, tokens, prefix, salt)
    new = c.alloc_device(len(tokens) - len(prefix))
    write_kv(c.device_pool, tokens, new, len(prefix), salt)
    c.insert(tokens, torch.cat([prefix, new]))
    c.release(lease)
    c.check_invariants()
    return m.tokens, m.device_tokens, m.host_tokens, m.storage_tokens_used, h.tokens


def requests(conversations: int = 4, turns: int = 6, seed: int = 5) -> list[np.ndarray]:
    """Conversations taking turns in a rotating order, each turn a page or two longer (<= 48 tokens)."""
    rng = np.random.default_rng(seed)
    convs = [rng.integers(0, 1000, 16) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for i in rng.permutation(conversations).tolist():
            convs[i] = np.concatenate([convs[i], rng.integers(0, 1000, PS * int(rng.integers(1, 3)))])[:48]
            out.append(convs[i])
    return out


def cache(spec_name: str, dev_slots: int, host_slots: int, ranks: RankGroup, **storage) -> CacheController:
    spec = preset(spec_name, page_size=PS)
    dev, host = DevicePool(spec, dev_slots, "cpu"), HostPool(spec, host_slots, "layer_first")
    mover = None
    if storage:
        fp = storage.pop("fingerprint", None) or ranks.fingerprint(MODEL, spec)
        mover = open_storage(StorageConfig(storage.pop("url"), **storage), host, fp)
    return CacheController(dev, host, CacheConfig(), storage=mover, ranks=ranks)


# -- scenarios, one process per rank ----------------------------------------------------


def same_calls(ranks: RankGroup, pools: dict) -> dict:
    """The same requests on every rank; `pools[rank]`: (device slots, host slots)."""
    dev_slots, host_slots = pools[ranks.rank]
    salt = ranks.rank  # K/V split by heads: each rank's own bytes
    with cache("tiny-mha", dev_slots, host_slots, ranks) as c:
        answers = [compute(c, t, salt, seed=i) for i, t in enumerate(requests())]
        out = {"answers": answers, "host_evictions": c.metrics.host_evictions}
        out["host_tokens_held"] = sum(len(n) for n in c.tree.nodes() if n.host_slots is not None)
        try:  # more than the smallest device pool: refused on every rank, whatever this rank has
            c.alloc_device(min(p[0] for p in pools.values()) + PS)
            out["big_alloc"] = "ok"
        except CacheFullError:
            out["big_alloc"] = "full"
        c.check_invariants()
        out["held_after"] = len(c.held_slots())
    return out


def store_once(ranks: RankGroup, store: str) -> dict:
    """An MLA spec over a `file://` store the ranks share: one writer, every rank reads."""
    tokens = np.arange(300, 340)
    with cache("tiny-mla", 64, 64, ranks, url=f"file://{store}", prefetch="wait_complete") as c:
        compute(c, tokens, salt=0, seed=1)  # the latent is the same on every rank
        c.flush()
        dist.barrier()  # the writer's pages are in the store
        evict_all(c)
        files = sorted(p.name for p in Path(store).rglob("*") if p.is_file())
        answer = compute(c, tokens, salt=0, seed=2)
        snap = c.storage.metrics.snapshot()
    return {"answer": answer, "files": files, "written": snap["pages_written"], "read": snap["pages_read"]}


def store_per_rank(ranks: RankGroup, store: str) -> dict:
    """A K/V spec over a shared store: each rank's pages under its own key, read by it alone."""
    spec = preset("tiny-mha", page_size=PS)
    out = {"fingerprint": ranks.fingerprint(MODEL, spec).hex}
    dev, host = DevicePool(spec, 64, "cpu"), HostPool(spec, 64, "layer_first")
    cfg = StorageConfig(f"file://{store}", prefetch="wait_complete")  # a loaded machine: no timeout
    mover = open_storage(cfg, host, Fingerprint.of(MODEL, spec))
    try:  # a fingerprint without the rank would let the ranks read each other's heads
        CacheController(dev, host, storage=mover, ranks=ranks)
        out["refused"] = ""
    except ConfigError as e:
        out["refused"] = str(e)
        mover.close(), dev.close(), host.close()
    tokens = np.arange(500, 532)
    with cache("tiny-mha", 64, 64, ranks, url=f"file://{store}", prefetch="wait_complete") as c:
        compute(c, tokens, salt=ranks.rank, seed=1)
        c.flush()
        dist.barrier()
        out["files"] = sorted(p.name for p in Path(store).rglob("*") if p.is_file())
        out["written"] = c.storage.metrics.snapshot()["pages_written"]
        evict_all(c)
        out["own"] = compute(c, tokens, salt=ranks.rank, seed=2)
        evict_all(c)
        m = c.match(tokens)  # every rank's store holds the pages now...
        dist.barrier()
        if ranks.rank == 1:  # ...and rank 1's are gone before it fetches them
            for p in Path(store).rglob(f"{out['fingerprint']}.*"):
                p.unlink()
        dist.barrier()
        lease = c.acquire(m)
        h = c.load_back(m)
        out["lost after the match"] = (m.storage_tokens, m.storage_tokens_used, h.tokens)
        c.release(lease)
        c.check_invariants()
        evict_all(c)
        out["without rank 1's"] = compute(c, tokens, salt=ranks.rank, seed=3)
    return out


def evict_all(c: CacheController) -> None:
    c.flush()
    c.evict_device(c.device_pool.num_slots)
    c.evict_host(c.host_pool.num_slots)
    assert c.tree.nodes() == []  # only storage holds them now


SCENARIOS = {"same_calls": same_calls, "store_once": store_once, "store_per_rank": store_per_rank}


def _entry(rank: int, world: int, init: str, results: str, scenario: str, arg) -> None:
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        out = SCENARIOS[scenario](RankGroup.from_distributed(), arg)
        with open(os.path.join(results, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def run(world: int, tmp_path: Path, scenario: str, arg) -> list[dict]:
    """`scenario(ranks, arg)` in `world` processes; each rank's result, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_entry, args=(world, f"tcp://127.0.0.1:{port}", str(results), scenario, arg), nprocs=world)
    out = []
    for r in range(world):
        with open(results / f"rank{r}.pkl", "rb") as f:
            out.append(pickle.load(f))
    return out


# -- tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_fed_the_same_calls_answer_as_one_process(tmp_path, world) -> None:
    pools = dict.fromkeys(range(world), (64, 112))
    got = run(world, tmp_path, "same_calls", pools)
    alone = same_calls(RankGroup.single(), {0: (64, 112)})
    assert all(g["answers"] == alone["answers"] for g in got)
    loaded = [a[4] for a in alone["answers"]]
    assert sum(a[2] > 0 for a in alone["answers"]) >= 3 and sum(loaded) > 0  # host hits were reloaded
    assert alone["host_evictions"] > 0  # and the host was full at times


@pytest.mark.parametrize(
    ("world", "pools"),
    [
        (2, {0: (64, 96), 1: (64, 160)}),
        (4, {0: (64, 96), 1: (64, 160), 2: (64, 128), 3: (64, 112)}),
        (2, {0: (48, 96), 1: (80, 160)}),  # the device pools differ too: device counts agreed
    ],
)
def test_ranks_with_pools_of_other_sizes_agree_on_every_match(tmp_path, world, pools) -> None:
    got = run(world, tmp_path, "same_calls", pools)
    for g in got[1:]:
        assert g["answers"] == got[0]["answers"]  # every call answered alike, bytes checked on each rank
    assert len({g["host_evictions"] for g in got}) > 1  # the small host evicted sooner...
    assert len({g["host_tokens_held"] for g in got}) > 1  # ...so the ranks hold different things
    assert sum(a[4] for a in got[0]["answers"]) > 0  # and reloads happened
    assert all(g["big_alloc"] == "full" and g["held_after"] == 0 for g in got)


@pytest.mark.parametrize("world", [2, 4])
def test_mla_pages_are_written_once_and_read_by_every_rank(tmp_path, world) -> None:
    store = tmp_path / "store"
    got = run(world, tmp_path, "store_once", str(store))
    pages = 40 // PS
    assert [g["written"] for g in got] == [pages] + [0] * (world - 1)  # the writer (rank 0) alone
    assert all(g["files"] == got[0]["files"] and len(g["files"]) == pages for g in got)
    assert all(not any("~" in f for f in g["files"]) for g in got)
    for g in got:  # every rank's hit came from storage, checked byte for byte on the rank
        assert g["answer"] == (40, 0, 0, 40, 40) and g["read"] == pages


def test_kv_pages_are_written_and_read_by_each_rank_under_its_own_key(tmp_path) -> None:
    store = tmp_path / "store"
    got = run(2, tmp_path, "store_per_rank", str(store))
    pages = 32 // PS
    assert all("storage keys" in g["refused"] for g in got)  # a key without the rank is refused everywhere
    fps = [g["fingerprint"] for g in got]
    assert fps[0] != fps[1]
    for g in got:
        assert g["written"] == pages
        assert sorted(f.split(".")[0] for f in g["files"]) == sorted(fps * pages)
        assert g["own"] == (32, 0, 0, 32, 32)  # its own pages, byte for byte (the ranks' bytes differ)
        # rank 1's pages gone: rank 0's, still there, serve neither rank
        assert g["lost after the match"] == (32, 0, 0)  # what arrived on every rank: nothing
        assert g["without rank 1's"] == (0, 0, 0, 0, 0)
