"""`kvtier bench served` on a tiny model: rows with every field, both configurations, cache consistent."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.bench import served  # noqa: E402


def test_measure_rows_for_kvtier_and_stock() -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    for config in served.CONFIGS:
        row = served._measure(model, "tiny", config, 128, torch.device("cpu"), cycles=2, repeats=1)
        assert row.config == config and row.prefix_tokens == 128
        assert row.kv_bytes == 128 * 2 * 2 * 2 * 16 * 4
        assert row.ttft_miss_s > 0 and row.ttft_device_hit_s > 0 and row.ttft_host_hit_s > 0
        assert row.ceiling_gbps > 0 and row.host_runs_before >= 1
