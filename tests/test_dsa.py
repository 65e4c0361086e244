"""DSA configs through kvtier: the indexer row in the spec, written by the engine, reloaded intact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import DSA, tiny_deepseek_v3, tiny_dsa  # noqa: E402

from kvtier.engine import Engine, SamplingParams, spec_from_hf_config  # noqa: E402
from kvtier.engine.hf import dsa_indexer_layers, layer_windows  # noqa: E402
from kvtier.engine.indexer import standin_rows  # noqa: E402
from kvtier.errors import SpecError  # noqa: E402
from kvtier.spec import INDEXER_ROW_BYTES, BufferKind, preset  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def model():
    return tiny_dsa(VOCAB)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain `model.generate`, greedy, no cache reuse."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def indexer_rows(eng: Engine, slots: torch.Tensor) -> list[torch.Tensor]:
    """`[layers][len(slots), 132]` uint8: the device's indexer rows at `slots`, copied."""
    pool = eng.device_pool
    return [pool.layer("indexer", layer)[slots].clone() for layer in eng.spec.buffer("indexer").layers]


def test_a_dsa_config_keeps_the_indexer_row_on_every_layer(model) -> None:
    spec = spec_from_hf_config(model.config, dtype=torch.bfloat16)
    assert [b.kind for b in spec.buffers] == [BufferKind.MLA_LATENT, BufferKind.INDEXER]
    ix = spec.buffer("indexer")
    assert ix.layers == (0, 1, 2) and ix.row_bytes == INDEXER_ROW_BYTES and ix.dtype == torch.uint8
    assert spec.bytes_per_token() == 3 * ((32 + 8) * 2 + 132)
    plain = spec_from_hf_config(tiny_deepseek_v3().config, dtype=torch.bfloat16)
    assert [b.kind for b in plain.buffers] == [BufferKind.MLA_LATENT]


def test_glm5s_own_config_maps_to_the_glm5_preset() -> None:
    """transformers' GLM-MoE-DSA config (GLM-5's defaults): 78 layers of 512 + 64 and the indexer."""
    got = spec_from_hf_config(transformers.GlmMoeDsaConfig(), dtype=torch.bfloat16)
    want = preset("glm-5")
    assert (got.num_layers, got.buffers) == (want.num_layers, want.buffers)
    assert got.bytes_per_token() == 78 * (1152 + 132)
    # A layer of "shared" indexer type reuses an earlier top-k and keeps no index key.
    every_other = transformers.GlmMoeDsaConfig(num_hidden_layers=6, index_topk_freq=2)
    assert dsa_indexer_layers(every_other) == (0, 1, 3, 5)
    assert spec_from_hf_config(every_other).buffer("indexer").layers == (0, 1, 3, 5)
    assert spec_from_hf_config(every_other).buffer("kv").layers == tuple(range(6))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"index_head_dim": 64}, "index_head_dim 64"),
        ({"index_topk": None}, "positive"),
        ({"indexer_types": ["full", "dense", "full"]}, "'full' and 'shared' only"),
    ],
)
def test_dsa_configs_kvtier_cannot_map_are_refused(change, message) -> None:
    config = tiny_dsa().config
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(SpecError, match=message):
        spec_from_hf_config(config)


def test_a_dsa_indexer_without_mla_is_refused() -> None:
    with pytest.raises(SpecError, match="DSA indexer but no MLA"):
        spec_from_hf_config(transformers.LlamaConfig(num_hidden_layers=2, **DSA))


def test_transformers_own_dsa_classes_are_refused_by_the_engine() -> None:
    """They write real index keys through `Cache.update_indexer`, which kvtier's step does not serve."""
    cfg = transformers.GlmMoeDsaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=2,
        num_experts_per_tok=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_n_heads=2,
        index_topk=4,
    )
    with pytest.raises(SpecError, match="update_indexer"):
        layer_windows(cfg)
    with pytest.raises(SpecError, match="update_indexer"):
        Engine(transformers.GlmMoeDsaForCausalLM(cfg).eval(), device_tokens=64, host_tokens=64)


def test_the_indexer_carrying_engine_generates_greedys_tokens(model) -> None:
    """Cold, device hit, host hit: the model ignores the indexer rows, so its tokens are generate's."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    want = greedy(model, prompt, 6)
    params = SamplingParams(max_tokens=6)
    with Engine(model, device_tokens=256, host_tokens=1024) as eng:
        assert eng.generate(prompt, params).tokens == want
        device = eng.generate(prompt, params)
        assert device.hit == "device" and device.tokens == want
        eng.cache.flush()
        eng.cache.evict_device(10**9)
        host = eng.generate(prompt, params)
        assert host.host_hit_tokens > 0 and host.tokens == want


def test_each_token_of_a_batch_gets_its_own_row_at_its_own_slots(model) -> None:
    """Two requests in the same steps (prefill pieces, then decodes, which replay CUDA graphs on a
    GPU): every token's row on every indexer layer, prompt and answer, is the stand-in of its position
    and id, where the cache says it lives."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (24, 37)]
    with Engine(model, device_tokens=256, host_tokens=1024, max_num_batched_tokens=32) as eng:
        reqs = [eng.submit(p, SamplingParams(max_tokens=6)) for p in prompts]
        while eng.busy:
            eng.step()
        assert [r.tokens for r in reqs] == [greedy(model, p, 6) for p in prompts]
        eng.cache.flush()
        for prompt, req in zip(prompts, reqs, strict=True):
            tokens = prompt + req.tokens[:-1]  # (the last answer token has no KV yet)
            m = eng.cache.match(tokens)
            assert m.device_tokens == len(tokens)
            got = indexer_rows(eng, m.device_slots)
            ids = torch.tensor(tokens)
            for layer, rows in enumerate(got):
                assert torch.equal(rows, standin_rows(torch.arange(len(tokens)), ids, layer)), layer
        assert not torch.equal(got[0], got[1])  # rows differ by layer


def test_indexer_rows_come_back_from_the_host_byte_identical(model) -> None:
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    with Engine(model, device_tokens=256, host_tokens=1024) as eng:
        eng.generate(prompt, SamplingParams(max_tokens=2))
        eng.cache.flush()
        m = eng.cache.match(prompt)
        written = indexer_rows(eng, m.device_slots)
        assert len(m.device_slots) == len(prompt)
        eng.cache.evict_device(10**9)
        for layer in eng.spec.buffer("indexer").layers:  # poison the device
            rows = eng.device_pool.layer("indexer", layer)
            rows.copy_(~rows)
        m = eng.cache.match(prompt)
        assert m.device_tokens == 0 and m.tokens == len(prompt)
        h = eng.cache.load_back(m)
        h.wait()
        got = indexer_rows(eng, h.device_slots)
        for layer, (a, b) in enumerate(zip(got, written, strict=True)):
            assert torch.equal(a, b), layer
        eng.cache.flush()


def test_a_step_without_ids_is_refused_for_an_indexer_spec(model) -> None:
    from kvtier.engine.batch import Piece, StepBatch
    from kvtier.errors import InvariantError

    with Engine(model, device_tokens=64, host_tokens=64) as eng:
        pieces = [Piece(torch.arange(4), 4)]
        with pytest.raises(InvariantError, match=r"needs \[4\] ids, got None"):
            StepBatch(eng.spec, eng.device_pool, pieces)
        with pytest.raises(InvariantError, match=r"needs \[4\] ids, got \(3,\)"):
            StepBatch(eng.spec, eng.device_pool, pieces, ids=torch.arange(3))


def test_dsa_fields_are_all_or_nothing() -> None:
    config = tiny_deepseek_v3(**{k: v for k, v in DSA.items() if k != "index_n_heads"}).config
    with pytest.raises(SpecError, match="positive"):
        dsa_indexer_layers(config)
