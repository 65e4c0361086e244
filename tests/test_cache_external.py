"""kvtier's host and storage tiers under a device tier another engine owns (as vLLM would).

`StandInEngine` owns its device blocks the way vLLM does: block ids into its own KV tensors
(`[num_blocks, block_size, *row]` per buffer and layer), a reference count per block, its
own prefix reuse by block hash, and a free queue it evicts from under pressure, telling the
cache which blocks it freed before it reuses them. kvtier never allocates a device slot:
it is told which blocks hold which pages (`insert`), answers what it holds beyond the
engine's own hit (`match`), and loads pages into blocks the engine allocated (`load_back(...,
into=)`), which are poisoned first; every page that comes back is compared with the KV the
reference path computes for its prefix (`kv_of`).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from test_cache_storage import kv_of

from kvtier.cache import CacheConfig, CacheController
from kvtier.cache.policy import LRU
from kvtier.cache.storage_mover import open_storage
from kvtier.cache.storage_tier import StorageTier
from kvtier.cache.tiers import DeviceTier, ExternalDeviceTier, HostTier
from kvtier.errors import CacheStateError, ConfigError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.spec import preset
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint

PS = 4  # the engine's block size is the cache's page size


class StandInEngine:
    """A plain loop owning device blocks as vLLM does (see the module docstring)."""

    def __init__(self, spec, num_blocks: int, seed: int = 0) -> None:
        self.spec, self.num_blocks = spec, num_blocks
        self.kv = {
            b.name: [torch.zeros(num_blocks, PS, *b.row_shape, dtype=b.dtype) for _ in b.layers]
            for b in spec.buffers
        }
        self.pool = DevicePool.wrap(
            spec, {name: [t.view(num_blocks * PS, *t.shape[2:]) for t in ts] for name, ts in self.kv.items()}
        )
        self.free_queue: deque[int] = deque(range(num_blocks))  # evictable, least recent first
        self.refs = [0] * num_blocks
        self.block_of: dict[tuple[int, ...], int] = {}  # prefix hash -> block
        self.hash_of: dict[int, tuple[int, ...]] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.cache: CacheController | None = None
        self.stats = {"engine_hit": 0, "loaded": 0, "computed": 0, "evicted_blocks": 0}

    def attach(self, cache: CacheController) -> None:
        self.cache = cache
        self.tier: ExternalDeviceTier = cache.device

    # -- the engine's own blocks ------------------------------------------------------------

    def rows(self, name: str, layer: int, block: int) -> torch.Tensor:
        """`[block_size, row bytes]` uint8 view of one block of one layer."""
        t = self.kv[name][self.spec.buffer(name).layers.index(layer)]
        return t[block].view(torch.uint8).reshape(PS, -1)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks from the free queue's head; cached ones are evicted (the cache told first)."""
        if n > len(self.free_queue):
            raise RuntimeError("the stand-in engine is out of blocks")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        evicted = [b for b in blocks if b in self.hash_of]
        if evicted:
            self.cache.device_freed(self.tier.slots(evicted))  # before anything reuses them
            for b in evicted:
                del self.block_of[self.hash_of.pop(b)]
            self.stats["evicted_blocks"] += len(evicted)
        for b in blocks:
            self.refs[b] = 1
            for buf in self.spec.buffers:  # poison: a load that misses a row shows
                for layer in buf.layers:
                    r = self.rows(buf.name, layer, b)
                    r.copy_(torch.randint(0, 256, r.shape, dtype=torch.uint8, generator=self.gen))
        return blocks

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # the tail first, as vLLM frees a request's blocks
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_queue.append(b)

    # -- a request ----------------------------------------------------------------------------

    def run(self, tokens: np.ndarray) -> dict[str, int]:
        """Serve `tokens` (whole pages): the engine's hit, then kvtier's, then compute the rest."""
        c, pages = self.cache, len(tokens) // PS
        hit: list[int] = []
        for p in range(pages):  # the engine's own prefix reuse by block hash
            b = self.block_of.get(tuple(tokens[: (p + 1) * PS].tolist()))
            if b is None:
                break
            if self.refs[b] == 0:
                self.free_queue.remove(b)
            self.refs[b] += 1
            hit.append(b)
        m = c.match(tokens)
        assert m.device_tokens == len(hit) * PS, "kvtier's device view is the engine's"
        lease = c.acquire(m)
        want = (m.host_tokens + m.storage_tokens) // PS
        fresh = self.allocate(pages - len(hit))  # room for kvtier's pages and the computed ones
        h = c.load_back(m, into=self.tier.slots(fresh[:want]) if want else torch.empty(0, dtype=torch.int64))
        h.wait()
        loaded = h.tokens // PS
        blocks = hit + fresh
        for p in range(len(hit), len(hit) + loaded):  # byte-identical to the reference path
            self.check_page(tokens, p, blocks[p])
        for p in range(len(hit) + loaded, pages):  # the model computes the rest
            self.write_page(tokens, p, blocks[p])
        for p in range(len(hit), pages):
            key = tuple(tokens[: (p + 1) * PS].tolist())
            self.block_of[key], self.hash_of[blocks[p]] = blocks[p], key
        c.insert(tokens, self.tier.slots(blocks))
        c.release(lease)
        self.release(blocks)
        c.check_invariants()
        out = {"engine_hit": len(hit), "loaded": loaded, "computed": pages - len(hit) - loaded}
        out["from_storage"] = m.storage_tokens_used // PS
        for k in ("engine_hit", "loaded", "computed"):
            self.stats[k] += out[k]
        return out

    def write_page(self, tokens: np.ndarray, page: int, block: int) -> None:
        for b in self.spec.buffers:
            for layer in b.layers:
                want = kv_of(tokens[: (page + 1) * PS], self.spec, b.name, layer)[-PS:]
                self.rows(b.name, layer, block).copy_(want)

    def check_page(self, tokens: np.ndarray, page: int, block: int) -> None:
        for b in self.spec.buffers:
            for layer in b.layers:
                want = kv_of(tokens[: (page + 1) * PS], self.spec, b.name, layer)[-PS:]
                got = self.rows(b.name, layer, block)
                assert torch.equal(got, want), f"page {page} ({b.name} layer {layer}) differs"


def external_cache(engine: StandInEngine, host_slots: int, storage=None, **cfg) -> CacheController:
    config = CacheConfig(**cfg)
    tiers = [ExternalDeviceTier(engine.pool, LRU()), HostTier(HostPool(engine.spec, host_slots), LRU())]
    if storage is not None:
        tiers.append(StorageTier(open_storage(storage, tiers[1].pool, Fingerprint.of("ext", engine.spec))))
    cache = CacheController.of(tiers, config)
    engine.attach(cache)
    return cache


def conversations(n: int = 4, turns: int = 5, seed: int = 3) -> list[np.ndarray]:
    """Requests with shared prefixes: a system prompt, then conversations growing a page or two."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, 2 * PS)
    convs = [np.concatenate([system, rng.integers(0, 1000, PS)]) for _ in range(n)]
    out = []
    for _ in range(turns):
        for i in rng.permutation(n).tolist():
            convs[i] = np.concatenate([convs[i], rng.integers(0, 1000, PS * int(rng.integers(1, 3)))])
            out.append(convs[i])
    return out


@pytest.mark.parametrize("spec_name", ["tiny-mha", "tiny-dsa"])
def test_pages_saved_to_the_host_come_back_into_fresh_engine_blocks(spec_name) -> None:
    spec = preset(spec_name, PS)
    engine = StandInEngine(spec, num_blocks=12)  # pressure: the engine evicts its own cache often
    with external_cache(engine, host_slots=256) as c:
        for tokens in conversations():
            engine.run(tokens)
        assert engine.stats["evicted_blocks"] > 0 and engine.stats["engine_hit"] > 0
        assert engine.stats["loaded"] > 0  # pages the engine had evicted came back from kvtier's host
        assert c.metrics.backups > 0 and c.device_alloc is None and c.evict_device(4) == 0
        c.flush()
        c.check_invariants()


def test_storage_hits_load_into_engine_blocks_after_a_restart(tmp_path) -> None:
    spec = preset("tiny-mha", PS)
    store = StorageConfig(f"file://{tmp_path / 'store'}", prefetch="wait_complete")
    requests = conversations(n=3, turns=3)
    engine = StandInEngine(spec, num_blocks=12)
    with external_cache(engine, host_slots=64, storage=store) as c:
        for tokens in requests:
            engine.run(tokens)
        assert c.storage.metrics.snapshot()["pages_written"] > 0
    engine = StandInEngine(spec, num_blocks=16, seed=1)  # a new process: only storage holds the KV
    with external_cache(engine, host_slots=64, storage=store) as c:
        got = engine.run(requests[-1])
        assert got["from_storage"] == got["loaded"] == len(requests[-1]) // PS
        assert c.metrics.storage_hit_tokens == len(requests[-1])


def test_what_an_engine_owned_device_refuses() -> None:
    spec = preset("tiny-mha", PS)
    engine = StandInEngine(spec, num_blocks=8)
    with external_cache(engine, host_slots=32) as c:
        with pytest.raises(CacheStateError, match="engine owns"):
            c.alloc_device(PS)
        with pytest.raises(CacheStateError, match="device_freed"):
            c.free_device(engine.tier.slots([0]))
        tokens = np.arange(2 * PS)
        engine.run(tokens)
        m = c.match(tokens)
        lease = c.acquire(m)
        with pytest.raises(CacheStateError, match="locked"):
            c.device_freed(engine.tier.slots([engine.block_of[tuple(tokens[:PS].tolist())]]))
        c.release(lease)
        assert c.match(tokens).device_tokens == 2 * PS  # the refused call changed nothing
        with pytest.raises(SlotError):
            engine.tier.slots([8])  # no such block
        m = c.match(np.arange(100, 100 + PS))
        with pytest.raises(CacheStateError, match="into="):
            c.load_back(m)
    kvtier_owned = CacheController(DevicePool(spec, 16), HostPool(spec, 16))
    with kvtier_owned, pytest.raises(CacheStateError, match="kvtier's own"):
        kvtier_owned.device_freed(torch.arange(PS))


def test_a_list_that_is_not_a_cache_is_refused() -> None:
    spec = preset("tiny-mha", PS)
    dev, host = DevicePool(spec, 16), HostPool(spec, 16)
    with pytest.raises(ConfigError, match="a device tier, a host tier"):
        CacheController.of([HostTier(host, LRU()), DeviceTier(dev, LRU())])
    with pytest.raises(ConfigError, match="a device tier, a host tier"):
        CacheController.of([DeviceTier(dev, LRU())])


def scan(tier: ExternalDeviceTier, slots: np.ndarray) -> set[tuple[int, int]]:
    """The reference for `nodes_on`: every node on the device, each checked for the slots."""
    freed = np.zeros(tier.num_slots, dtype=bool)
    freed[slots] = True
    out = set()
    for n in tier.queue.nodes():
        pages = freed[n.device_slots.numpy()].reshape(-1, PS).any(axis=1)
        if pages.any():
            out.add((n.id, int(pages.argmax())))
    return out


def test_the_freed_blocks_index_finds_what_a_scan_of_every_node_finds() -> None:
    """`device_freed` reads an index of slots by node, kept through inserts, splits, loads into
    reused blocks and evictions; at every step it answers what a scan of every node answers."""
    spec = preset("tiny-mha", PS)
    engine = StandInEngine(spec, num_blocks=20)
    rng = np.random.default_rng(5)
    with external_cache(engine, host_slots=512):
        tier = engine.tier
        for tokens in conversations(n=5, turns=6):
            engine.run(tokens)  # checks the invariants, the index's among them
            for _ in range(4):
                blocks = rng.choice(engine.num_blocks, size=int(rng.integers(1, 7)), replace=False)
                slots = tier.slots(blocks).numpy()
                got = {(n.id, first) for n, first in tier.nodes_on(slots)}
                assert got == scan(tier, slots)
        assert engine.stats["evicted_blocks"] > 0 and engine.stats["loaded"] > 0
        assert tier.nodes_on(np.empty(0, dtype=np.int64)) == []


def test_a_block_freed_inside_a_node_splits_it_there() -> None:
    spec = preset("tiny-mha", PS)
    engine = StandInEngine(spec, num_blocks=8)
    with external_cache(engine, host_slots=64) as c:
        tokens = np.arange(3 * PS)
        engine.run(tokens)  # one node on blocks 0, 1, 2
        assert len(c.tree.nodes()) == 1
        c.flush()  # its backup is done: it leaves the device with its host copy kept
        assert c.device_freed(engine.tier.slots([1])) == 2 * PS  # pages 1-2 leave, page 0 stays
        m = c.match(tokens)
        assert (m.device_tokens, m.host_tokens) == (PS, 2 * PS)
        assert c.device_freed(engine.tier.slots([1, 2])) == 0  # freed already: nothing on them
        assert c.device_freed(engine.tier.slots([0])) == PS
        c.check_invariants()
