"""The cache state machine with a third tier: storage on the real file system, with faults.

The rules of `CacheMachine` (requests, reads, leases, evictions of both tiers, transfer
steps) run over a cache whose host evictions fall through to a file store read back by
real worker threads; new rules corrupt or truncate stored values and make the backend fail
for a while. KV is a function of the token prefix (as a model's is), so a page read back
from storage is compared with the same truth as one computed again: after every step the
invariants hold, and no read ever yields bytes other than the computed ones.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_cache_stateful import PS, SETTINGS, CacheMachine, sequences

from kvtier.cache import WritePolicy
from kvtier.cache.storage_mover import open_storage
from kvtier.storage.config import StorageConfig
from kvtier.storage.keys import Fingerprint


class StorageMachine(CacheMachine):
    prefetch = "wait_complete"
    write = "write_through"

    def _storage(self):
        self.root = tempfile.mkdtemp(prefix="kvtier-store-")
        url = f"test_cache_storage:Flaky?path={self.root}"
        cfg = StorageConfig(url, write=self.write, prefetch=self.prefetch, workers=2, batch_pages=2)
        return open_storage(cfg, self.host, Fingerprint.of("machine", self.spec))

    def _new_kv(self, tokens, first_page, slots):
        """The KV of each page is a function of its prefix: the same bytes whenever computed."""
        pages = []
        for p in range(len(slots) // PS):
            prefix = tokens[: (first_page + p + 1) * PS]
            seed = int.from_bytes(hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest(), "little")
            pages += self._write_kv(slots[p * PS : (p + 1) * PS], torch.Generator().manual_seed(seed))
        return pages

    def _files(self) -> list[str]:
        return sorted(os.path.join(d, f) for d, _, files in os.walk(self.root) for f in files if "~" not in f)

    @precondition(lambda self: hasattr(self, "root"))
    @rule(
        pick=st.integers(0, 10**6), at=st.integers(0, 10**6), how=st.sampled_from(["flip", "cut", "delete"])
    )
    def damage_a_stored_value(self, pick: int, at: int, how: str) -> None:
        # Draws never depend on what the workers have written so far (hypothesis replays them).
        files = self._files()
        if not files:
            return
        path = files[pick % len(files)]
        if how == "delete":
            os.unlink(path)
            return
        raw = bytearray(Path(path).read_bytes())
        if not raw:
            return
        if how == "flip":
            raw[at % len(raw)] ^= 0x5A
        else:
            raw = raw[: at % len(raw)]
        with open(path, "wb") as f:
            f.write(raw)

    @precondition(lambda self: hasattr(self, "root"))
    @rule(broken=st.booleans())
    def storage_fails(self, broken: bool) -> None:
        self.cache.storage.backend.broken = broken

    @rule(tokens=sequences())
    def insert_slots_not_held(self, tokens: tuple[int, ...]) -> None:
        # Storage work finishing in the background frees write-back pages at the next poll:
        # finish it first, so what the refused insert must not change is what it saw.
        self.cache.flush()
        super().insert_slots_not_held(tokens)

    @rule()
    def wait_for_storage(self) -> None:
        self.cache.flush()
        self.cache.poll()

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        try:
            self.cache.storage.backend.broken = False
            for lease in self.leases:
                self.cache.release(lease)
            self.leases = []
            # Write-back frees a host leaf once storage holds it, and only then is its
            # parent a leaf: a round per level of the tree.
            for _ in range(64):
                self.cache.flush()
                self.cache.evict_device(10**6)
                self.cache.evict_host(10**6)
                self.cache.flush()
                if self.cache.host_alloc.available() == self.host.num_slots:
                    break
            self.cache.check_invariants()
            assert self.cache.device_alloc.available() == self.dev.num_slots
            assert self.cache.host_alloc.available() == self.host.num_slots
            assert self.cache.storage.metrics.snapshot()["errors"]["exists"] == 0
        finally:
            self.cache.close()
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.mark.parametrize(
    ("spec_name", "layout", "prefetch", "write"),
    [
        ("tiny-mha", "layer_first", "wait_complete", "write_through"),
        ("tiny-dsa", "page_first", "best_effort", "write_through"),
        ("tiny-mla", "layer_first", "wait_complete", "write_back"),
    ],
)
def test_cache_state_machine_with_storage(spec_name: str, layout: str, prefetch: str, write: str) -> None:
    attrs = {
        "spec_name": spec_name,
        "layout": layout,
        "prefetch": prefetch,
        "write": write,
        "policy": WritePolicy.WRITE_THROUGH,
        "eviction": "lru",
    }
    machine = type(f"Storage_{spec_name}_{layout}_{prefetch}_{write}", (StorageMachine,), attrs)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
