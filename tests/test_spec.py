"""KV specs: presets follow the public configs, byte counts add up, bad specs are refused."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import SpecError
from kvtier.spec import PRESETS, BufferKind, BufferSpec, KVSpec, mla_spec, preset


def test_llama_3_1_8b() -> None:
    spec = preset("llama-3.1-8b")
    assert spec.num_layers == 32
    assert [b.kind for b in spec.buffers] == [BufferKind.K, BufferKind.V]
    assert spec.buffer("k").row_shape == (8, 128)
    assert spec.bytes_per_token("k") == 32 * 8 * 128 * 2
    assert spec.bytes_per_token() == 131072  # 128 KiB per token


def test_deepseek_v3_variants() -> None:
    bf16 = preset("deepseek-v3")
    assert bf16.num_layers == 61
    assert bf16.buffer("kv").row_shape == (576,)
    assert bf16.buffer("kv").row_bytes == 1152
    assert bf16.bytes_per_token() == 61 * 1152
    # One layer of a 128k-token prefix is the 151 MB the anchors measure.
    assert 131072 * bf16.layer_bytes_per_token(0) == 150_994_944
    fp8 = preset("deepseek-v3-fp8")
    assert fp8.buffer("kv").dtype == torch.float8_e4m3fn and fp8.buffer("kv").row_bytes == 576
    packed = preset("deepseek-v3-fp8-packed")
    assert packed.buffer("kv").row_bytes == 656 and packed.buffer("kv").dtype == torch.uint8


def test_glm5_carries_the_dsa_indexer() -> None:
    spec = preset("glm-5")
    idx = spec.buffer("indexer")
    assert idx.kind is BufferKind.INDEXER and idx.row_bytes == 132 and idx.dtype == torch.uint8
    assert spec.bytes_per_token() == 78 * (1152 + 132)
    assert preset("glm-5-fp8").layer_bytes_per_token(3) == 656 + 132


def test_indexer_on_some_layers_only() -> None:
    spec = preset("tiny-dsa")
    assert spec.buffer("indexer").layers == (0, 2)
    assert [b.name for b in spec.buffers_on(1)] == ["kv"]
    assert [b.name for b in spec.buffers_on(2)] == ["kv", "indexer"]
    assert spec.bytes_per_token("indexer") == 2 * 132
    assert spec.buffer("indexer").local_layer(2) == 1
    with pytest.raises(SpecError, match="no layer 1"):
        spec.buffer("indexer").local_layer(1)


def test_every_preset_builds_with_every_page_size() -> None:
    """Paging changes how slots group, never what a token holds."""
    for name in PRESETS:
        flat = preset(name)
        for ps in (16, 64):
            spec = preset(name, ps)
            assert spec.page_size == ps and spec.name == name
            assert spec.buffers == flat.buffers and spec.bytes_per_token() == flat.bytes_per_token()


def test_with_layers_cuts_the_model() -> None:
    spec = preset("tiny-dsa").with_layers(2)
    assert spec.num_layers == 2 and spec.buffer("indexer").layers == (0,)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: preset("no-such-model"), "unknown spec preset"),
        (lambda: BufferSpec("x", BufferKind.K, (0,), torch.bfloat16, (0,)), "positive"),
        (lambda: BufferSpec("x", BufferKind.K, (4,), torch.int8, (0,)), "dtype"),
        (lambda: BufferSpec("x", BufferKind.K, (4,), torch.bfloat16, ()), "no layers"),
        (lambda: BufferSpec("x", BufferKind.K, (4,), torch.bfloat16, (1, 0)), "ascending"),
        (lambda: mla_spec("m", 2, indexer_layers=(5,)), "layer 5"),
        (lambda: mla_spec("m", 2, page_size=0), "page_size"),
        (
            lambda: KVSpec("m", 2, (BufferSpec("x", BufferKind.K, (4,), torch.bfloat16, (0,)),)),
            "carry no buffer",
        ),
        (lambda: mla_spec("m", 2, 256, 32, packed_fp8=True), "packed"),
    ],
)
def test_bad_specs_are_refused(make, message) -> None:
    with pytest.raises(SpecError, match=message):
        make()
