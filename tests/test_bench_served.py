"""`kvtier bench served` on a tiny model: both configurations, one engine alive at a time."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier.bench import served
from kvtier.errors import ConfigError


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


def test_the_glm5_setup_keeps_glm5s_bytes_per_token() -> None:
    """78 layers of the 1152-byte MLA row and the 132-byte DSA indexer row, in bf16 as on CUDA."""
    from kvtier.engine import spec_from_hf_config
    from kvtier.spec import preset

    config = served.model_config("glm-5")
    spec = spec_from_hf_config(config, dtype=torch.bfloat16)
    assert (spec.num_layers, spec.buffers) == (78, preset("glm-5").buffers)
    assert spec.bytes_per_token() == 78 * (1152 + 132)
    assert spec_from_hf_config(served.model_config("glm-5", layers=3)).buffer("indexer").layers == (0, 1, 2)
    assert served.spec_summary("deepseek-v3", torch.device("cuda"))["buffers"] == {
        "kv": {"row_bytes": 1152, "layers": 61}
    }
    with pytest.raises(ConfigError, match="unknown setup 'glm-6'"):
        served.model_config("glm-6")
    with pytest.raises(ConfigError, match="layers must be a positive int, got 0"):
        served.model_config("glm-5", layers=0)


def test_bench_served_runs_the_glm5_setup_cut_to_two_layers(tmp_path) -> None:
    from kvtier import cli

    out = tmp_path / "served.json"
    argv = ["bench", "served", "--setups", "glm-5", "--layers", "2", "--prefix", "64", "--device", "cpu"]
    assert cli.main([*argv, "--repeats", "1", "--cycles", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    per_token = 2 * (576 * 4 + 132)  # float32 on the CPU: the latent row, then the indexer row
    assert report["meta"]["specs"]["glm-5"] == {
        "layers": 2,
        "buffers": {"kv": {"row_bytes": 576 * 4, "layers": 2}, "indexer": {"row_bytes": 132, "layers": 2}},
        "bytes_per_token": per_token,
    }
    rows = report["rows"]
    assert [(r["setup"], r["config"], r["prefix_tokens"]) for r in rows] == [
        ("glm-5", c, 64) for c in served.CONFIGS
    ]
    for r in rows:
        assert r["kv_bytes"] == 64 * per_token
        assert r["ttft_host_hit_s"] > 0 and r["ttft_device_hit_s"] > 0 and r["ceiling_gbps"] > 0
