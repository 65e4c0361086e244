"""Random interleavings of cache operations keep the invariants and the bytes.

A hypothesis state machine plays a serving engine against a small `CacheController`
(CPU pools, deferred lanes so transfers complete only when stepped or waited for):
requests that match, lock, load back or recompute, write fresh KV for their new
tokens and insert; evictions from either tier; leases held across steps and
released; transfers stepped one item at a time. A model keeps the KV every page
prefix must hold. After every step the invariants hold, and every read of a cached
prefix, after any number of device -> host -> device trips, equals the model.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.cache import CacheConfig, CacheController, WritePolicy
from kvtier.errors import CacheFullError, LeaseError, SlotError
from kvtier.pool import DevicePool, HostPool
from kvtier.pool.rows import as_words
from kvtier.spec import preset
from kvtier.transfer.lanes import DeferredLane

PS = 2
BASES = [(0, 1) * 8, (2, 3, 0, 1) * 4, (1, 1, 2, 2) * 4]


def sequences() -> st.SearchStrategy[tuple[int, ...]]:
    """Whole-page token sequences that share prefixes often: a base's prefix plus a short tail."""
    return st.builds(
        lambda base, cut, tail: (base[: cut * PS] + tuple(tail))[: len(tail) // PS * PS + cut * PS],
        st.sampled_from(BASES),
        st.integers(0, 8),
        st.lists(st.integers(0, 3), min_size=0, max_size=6),
    ).filter(lambda s: len(s) >= PS)


class CacheMachine(RuleBasedStateMachine):
    spec_name = "tiny-dsa"
    policy = WritePolicy.WRITE_THROUGH
    layout = "layer_first"
    eviction = "lru"

    @initialize()
    def build(self) -> None:
        self.spec = preset(self.spec_name, PS)
        self.dev = DevicePool(self.spec, 24)
        self.host = HostPool(self.spec, 32, self.layout)
        self.cache = CacheController(
            self.dev,
            self.host,
            CacheConfig(write_policy=self.policy, selective_hits=2, eviction=self.eviction),
            storage=self._storage(),
        )
        self.gen = torch.Generator().manual_seed(7)
        self.truth: dict[tuple[int, ...], dict[tuple[str, int], torch.Tensor]] = {}
        self.leases = []

    # -- helpers -------------------------------------------------------------------------

    def _storage(self):
        return None

    def _new_kv(
        self, tokens: tuple[int, ...], first_page: int, slots: torch.Tensor
    ) -> list[dict[tuple[str, int], torch.Tensor]]:
        """Write new KV for pages `first_page`... of `tokens` to `slots`; one dict per page of rows.

        Random words: a recomputed prefix gets other bytes, so a stale copy anywhere shows.
        """
        return self._write_kv(slots, self.gen)

    def _write_kv(
        self, slots: torch.Tensor, gen: torch.Generator
    ) -> list[dict[tuple[str, int], torch.Tensor]]:
        per_page = [{} for _ in range(len(slots) // PS)]
        for b in self.spec.buffers:
            for layer in b.layers:
                w = as_words(self.dev.layer(b.name, layer))
                raw = torch.randint(
                    0, 256, (len(slots), w.shape[1] * w.element_size()), dtype=torch.uint8, generator=gen
                )
                rows = raw.view(w.dtype)
                w[slots] = rows
                for p in range(len(per_page)):
                    per_page[p][(b.name, layer)] = rows[p * PS : (p + 1) * PS].clone()
        return per_page

    def _check_rows(self, tokens: tuple[int, ...], slots: torch.Tensor) -> None:
        for p in range(len(slots) // PS):
            want = self.truth[tokens[: (p + 1) * PS]]
            for (name, layer), rows in want.items():
                got = as_words(self.dev.layer(name, layer))[slots[p * PS : (p + 1) * PS]]
                assert torch.equal(got, rows), f"page {p} of {tokens}: {name} layer {layer} differs"

    # -- rules ---------------------------------------------------------------------------

    @rule(tokens=sequences(), load=st.booleans())
    def request(self, tokens: tuple[int, ...], load: bool) -> None:
        """A request: match, lock, load back (or recompute the host part), new KV, insert, release."""
        c = self.cache
        m = c.match(tokens)
        lease = c.acquire(m)
        try:
            if load:
                try:
                    h = c.load_back(m)
                except CacheFullError:  # the device is full of locked nodes
                    return
                for layer in range(self.spec.num_layers):
                    h.wait_layer(layer)
                reused = torch.cat([m.device_slots, h.device_slots])
                self._check_rows(tokens, reused)
            else:
                reused = m.device_slots
                self._check_rows(tokens, reused)
            try:
                new = c.alloc_device(len(tokens) - len(reused))
            except CacheFullError:
                return
            first_new = len(reused) // PS
            pages = self._new_kv(tokens, first_new, new)
            for i, page in enumerate(pages):
                self.truth[tokens[: (first_new + i + 1) * PS]] = page
            c.insert(tokens, torch.cat([reused, new]))
        finally:
            c.release(lease)
        m2 = c.match(tokens)
        assert m2.tokens == len(tokens)

    @rule(tokens=sequences())
    def read(self, tokens: tuple[int, ...]) -> None:
        """Read a cached prefix back, loading what is on the host; bytes equal the model."""
        c = self.cache
        m = c.match(tokens)
        lease = c.acquire(m)
        try:
            h = c.load_back(m)
            h.wait()
            self._check_rows(tokens, torch.cat([m.device_slots, h.device_slots]))
        except CacheFullError:
            pass
        finally:
            c.release(lease)

    @rule(tokens=sequences())
    def hold(self, tokens: tuple[int, ...]) -> None:
        self.leases.append(self.cache.acquire(self.cache.match(tokens)))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.cache.release(lease)
        with pytest.raises(LeaseError):
            self.cache.release(lease)

    @rule(tokens=st.integers(1, 24))
    def evict_device(self, tokens: int) -> None:
        self.cache.evict_device(tokens)

    @rule(tokens=st.integers(1, 32))
    def evict_host(self, tokens: int) -> None:
        self.cache.evict_host(tokens)

    @rule(items=st.integers(1, 4))
    def step_transfers(self, items: int) -> None:
        for lane in (self.cache.mover.backup_lane, self.cache.mover.load_lane):
            assert isinstance(lane, DeferredLane)
            lane.step(items)
        self.cache.poll()

    @rule(tokens=sequences())
    def insert_slots_not_held(self, tokens: tuple[int, ...]) -> None:
        """Inserting slots the caller does not own raises and changes nothing."""
        c = self.cache
        m = c.match(tokens)  # (may start selective backups, so the snapshot comes after it)
        free = torch.from_numpy((~c.device_alloc.allocated_mask()).nonzero()[0])
        if m.tokens == len(tokens) or len(free) < len(tokens) - m.device_tokens:
            return
        before = (c.device_alloc.available(), c.host_alloc.available(), sorted(n.id for n in c.tree.nodes()))
        with pytest.raises(SlotError, match="not held"):
            c.insert(tokens, torch.cat([m.device_slots, free[: len(tokens) - m.device_tokens]]))
        after = (c.device_alloc.available(), c.host_alloc.available(), sorted(n.id for n in c.tree.nodes()))
        assert before == after

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            for lease in self.leases:
                self.cache.release(lease)
            self.cache.flush()
            self.cache.check_invariants()
            # Nothing leaks: with no leases, evicting everything frees every slot.
            self.cache.evict_device(10**6)
            self.cache.evict_host(10**6)
            assert self.cache.device_alloc.available() == self.dev.num_slots
            assert self.cache.host_alloc.available() == self.host.num_slots


SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _machine(spec_name: str, policy: WritePolicy, layout: str, eviction: str) -> type[CacheMachine]:
    attrs = {"spec_name": spec_name, "policy": policy, "layout": layout, "eviction": eviction}
    return type(f"Cache_{spec_name}_{policy.value}_{layout}_{eviction}", (CacheMachine,), attrs)


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize(
    ("spec_name", "layout", "eviction"),
    [
        ("tiny-mha", "layer_first", "lru"),
        ("tiny-mla", "layer_first", "lfu"),
        ("tiny-dsa", "layer_first", "lru"),
        ("tiny-dsa", "page_first", "lfu"),
    ],
)
def test_cache_state_machine(spec_name: str, layout: str, eviction: str, policy: WritePolicy) -> None:
    machine = _machine(spec_name, policy, layout, eviction)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
