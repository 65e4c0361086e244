"""`kvtier bench served` on a tiny model: both configurations, one engine alive at a time."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier.bench import served


def test_prefixes_past_the_context_are_cut_to_fit_once() -> None:
    said: list[str] = []
    got = served.fit_prefixes((2048, 8192, 32768), 8192, said.append, "smollm2")
    assert got == [2048, 8128]
    assert len(said) == 2 and "8128" in said[0]
    assert served.fit_prefixes((8192, 131072), 163840, said.append, "deepseek-v3") == [8192, 131072]


def test_one_configuration_is_freed_before_the_next_is_built(monkeypatch) -> None:
    """Two configurations of a long prefix do not fit the host at once: when the bench builds an
    engine, no earlier engine's host pool is alive. Each engine here sits in a reference cycle (as
    one can through its cache's callbacks) and the collector is off, as between its automatic
    runs: such an engine is freed only if the bench closes it and collects before the next."""
    live: weakref.WeakSet = weakref.WeakSet()
    alive_at_build: list[int] = []

    class Recording(served.Engine):
        def __init__(self, *args, **kw) -> None:
            alive_at_build.append(len(live))
            super().__init__(*args, **kw)
            live.add(self.host_pool)
            self.cycle = self

    monkeypatch.setattr(served, "Engine", Recording)
    model = tiny_llama(max_positions=1024)
    gc.collect()
    gc.disable()
    try:
        rows = served.measure_setup(model, "tiny", (128, 192), torch.device("cpu"), 1, 1, lambda _m: None)
    finally:
        gc.enable()
    assert [(r.prefix_tokens, r.config) for r in rows] == [(n, c) for n in (128, 192) for c in served.CONFIGS]
    for r in rows:  # 2 layers of K and V, 2 KV heads of 16 float32 values
        assert r.kv_bytes == r.prefix_tokens * 2 * 2 * 2 * 16 * 4
        assert r.ttft_miss_s > 0 and r.ttft_device_hit_s > 0 and r.ttft_host_hit_s > 0
        assert r.host_runs_before > 1  # the churn left the host pool's free space in pieces
    assert alive_at_build == [0, 0, 0, 0]
    assert len(live) == 0
