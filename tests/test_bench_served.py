"""`kvtier bench served` on a tiny model: rows with every field, both configurations, cache consistent."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier.bench import served


def test_measure_rows_for_kvtier_and_stock() -> None:
    model = tiny_llama(max_positions=1024)
    for config in served.CONFIGS:
        row = served._measure(model, "tiny", config, 128, torch.device("cpu"), cycles=2, repeats=1)
        assert row.config == config and row.prefix_tokens == 128
        assert row.kv_bytes == 128 * 2 * 2 * 2 * 16 * 4
        assert row.ttft_miss_s > 0 and row.ttft_device_hit_s > 0 and row.ttft_host_hit_s > 0
        assert row.ceiling_gbps > 0 and row.host_runs_before >= 1


def test_prefixes_past_the_context_are_cut_to_fit_once() -> None:
    said: list[str] = []
    got = served.fit_prefixes((2048, 8192, 32768), 8192, said.append, "smollm2")
    assert got == [2048, 8128]
    assert len(said) == 2 and "8128" in said[0]
    assert served.fit_prefixes((8192, 131072), 163840, said.append, "deepseek-v3") == [8192, 131072]
