"""Real (tiny, random) transformers models through kvtier: the same tokens with and without the cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import tiny_deepseek_v3, tiny_llama  # noqa: E402

from kvtier.engine import Engine, SamplingParams, spec_from_hf_config  # noqa: E402
from kvtier.errors import (  # noqa: E402
    CacheStateError,
    ClosedError,
    ConfigError,
    PromptTooLongError,
    SpecError,
)
from kvtier.spec import BufferKind  # noqa: E402

VOCAB = 256


MODELS = {"gqa": tiny_llama, "mla": tiny_deepseek_v3}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Plain `model.generate` without any cache reuse, and the logits of the first new token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return out[0, len(prompt) :].tolist(), logits


def assert_nothing_held(eng: Engine) -> None:
    """No request still locks a node or holds device slots: evicting everything empties the device.

    A leftover lease would pin its path on the device, and slots held but neither inserted
    nor freed belong to no node, so either leaves the device pool short. (Moves the cache's
    device nodes to the host: call it last.)
    """
    eng.cache.flush()
    eng.cache.check_invariants()
    eng.cache.evict_device(10**9)
    assert eng.cache.device_alloc.available() == eng.device_pool.num_slots


def assert_same(result, ref_tokens, ref_logits) -> None:
    assert result.tokens == ref_tokens
    rel = (result.first_logits - ref_logits).norm() / ref_logits.norm()
    assert rel < 1e-5, rel


def test_spec_from_config_maps_gqa_and_mla(model) -> None:
    spec = spec_from_hf_config(model.config, dtype=torch.float32)
    kinds = [b.kind for b in spec.buffers]
    if hasattr(model.config, "kv_lora_rank"):
        assert kinds == [BufferKind.MLA_LATENT] and spec.buffers[0].row_shape == (32 + 8,)
    else:
        assert kinds == [BufferKind.K, BufferKind.V] and spec.buffers[0].row_shape == (2, 16)


def test_cold_device_host_and_ten_round_trips_generate_the_same_tokens(model) -> None:
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    ref_tokens, ref_logits = reference(model, prompt, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0)

    cold = eng.generate(prompt, params)
    assert cold.hit == "none"
    assert_same(cold, ref_tokens, ref_logits)

    resident = eng.generate(prompt, params)
    assert resident.hit == "device" and resident.device_hit_tokens == len(prompt) - 1
    assert_same(resident, ref_tokens, ref_logits)

    for trip in range(10):
        eng.cache.flush()
        eng.cache.evict_device(10**6)  # everything to the host
        reloaded = eng.generate(prompt, params)
        assert reloaded.hit == "host" and reloaded.loaded_tokens > 0, trip
        assert_same(reloaded, ref_tokens, ref_logits)
    eng.cache.flush()
    eng.cache.check_invariants()  # host and device copies byte-identical


def test_a_second_turn_reuses_the_first_and_matches_generate(model) -> None:
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    gen = torch.Generator().manual_seed(2)
    turn1 = torch.randint(0, VOCAB, (32,), generator=gen).tolist()
    r1 = eng.generate(turn1, SamplingParams(max_tokens=6))
    turn2 = turn1 + r1.tokens + torch.randint(0, VOCAB, (10,), generator=gen).tolist()
    eng.cache.flush()
    eng.cache.evict_device(10**6)
    r2 = eng.generate(turn2, SamplingParams(max_tokens=6))
    assert r2.host_hit_tokens >= len(turn1)
    assert_same(r2, *reference(model, turn2, 6))


def test_sampling_is_reproducible_with_a_seed(model) -> None:
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    prompt = list(range(20))
    p = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3)
    assert eng.generate(prompt, p).tokens == eng.generate(prompt, p).tokens


def test_bad_input_raises_and_leaves_the_cache_consistent(model) -> None:
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    eng.generate(list(range(30)), SamplingParams(max_tokens=4))
    before = eng.cache.fragmentation()
    with pytest.raises(PromptTooLongError, match="context of 512"):
        eng.generate(list(range(600)), SamplingParams(max_tokens=4))
    # Fits the context, not the device pool: refused before anything is evicted.
    with pytest.raises(PromptTooLongError, match="the device pool has 256"):
        eng.generate(list(range(250)), SamplingParams(max_tokens=10))
    with pytest.raises(ConfigError, match="empty"):
        eng.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Engine(model, device_tokens=256, host_tokens=1024, max_num_batched_tokens=0)
    assert eng.cache.fragmentation() == before
    assert eng.cache.match(list(range(30))).tokens == 30  # what the good request cached is still there
    assert_nothing_held(eng)


def test_a_config_kvtier_cannot_map_is_refused() -> None:
    with pytest.raises(SpecError, match="num_attention_heads"):
        spec_from_hf_config(transformers.PretrainedConfig(num_hidden_layers=2))
    hybrid = transformers.LlamaConfig(num_hidden_layers=2)
    hybrid.layer_types = ["full_attention", "linear_attention"]  # sliding layers: test_sliding_window.py
    with pytest.raises(SpecError, match="'full_attention' and 'sliding_attention' only"):
        spec_from_hf_config(hybrid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_engine_matches_generate_after_reloads(name) -> None:
    """On the GPU: pinned host pool, loads on the cache's stream, layers waited for by the forward."""
    model = MODELS[name]().cuda()
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False)
        ref_tokens = ref[0, len(prompt) :].tolist()
        ref_logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
    params = SamplingParams(max_tokens=8)
    assert_same(eng.generate(prompt, params), ref_tokens, ref_logits)
    for _ in range(3):
        eng.cache.flush()
        eng.cache.evict_device(10**6)
        r = eng.generate(prompt, params)
        assert r.hit == "host"
        assert_same(r, ref_tokens, ref_logits)
    eng.cache.flush()
    eng.cache.check_invariants()


def test_closing_a_stream_early_keeps_the_cache_consistent(model) -> None:
    """A client that goes away mid-stream: computed tokens are kept, the rest freed, the lease released."""
    eng = Engine(model, device_tokens=256, host_tokens=1024)
    prompt = list(range(40))
    stream = eng.stream(prompt, SamplingParams(max_tokens=20))
    got = [next(stream) for _ in range(3)]
    stream.close()
    # The prompt and the first two new tokens (whose KV was computed) are cached now.
    assert eng.cache.match(prompt + got[:2]).tokens == len(prompt) + 2
    assert_nothing_held(eng)


def test_chunked_prefill_generates_the_same_tokens(model) -> None:
    eng = Engine(model, device_tokens=256, host_tokens=1024, max_num_batched_tokens=7)
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_same(eng.generate(prompt, SamplingParams(max_tokens=6)), *reference(model, prompt, 6))
    eng.cache.flush()
    eng.cache.check_invariants()


def test_a_closed_engine_releases_its_pools_and_refuses_requests(model) -> None:
    with Engine(model, device_tokens=256, host_tokens=1024) as eng:
        eng.generate(list(range(20)), SamplingParams(max_tokens=3))
    assert eng.closed and eng.host_pool.closed and eng.device_pool.closed
    with pytest.raises(ClosedError, match="closed"):
        eng.generate(list(range(20)), SamplingParams(max_tokens=3))
    eng.close()  # idempotent


def test_an_engine_whose_cache_cannot_be_built_closes_its_pools(model, monkeypatch) -> None:
    import kvtier.engine.lockstep as lockstep_module  # builds the engine's cache

    given = []

    def refuse(device_pool, host_pool, config=None, storage=None, ranks=None):
        given.extend([device_pool, host_pool])
        raise CacheStateError("no cache here")

    monkeypatch.setattr(lockstep_module, "CacheController", refuse)
    with pytest.raises(CacheStateError, match="no cache here"):
        Engine(model, device_tokens=256, host_tokens=1024)
    assert len(given) == 2 and all(pool.closed for pool in given)
