"""Sliding-window models (Gemma 2 / 3, Mistral) through the engine: the tokens of `model.generate`.

Tiny random models in fp32 with a window of 8 and prompts of 20-60 tokens, so every
prompt runs past the window. Each run is compared with plain greedy forwards of the
model (no cache, transformers' own masks) and with `generate` up to its EOS; models of
the same weights with another window (7, 9, none) or, for Gemma 2, without soft-capping
give other logits, so an engine that ignored the window, misplaced it by a token or
dropped the cap fails. The last test serves a tiny Gemma through the official openai client.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402
from tiny_models import tiny_gemma2, tiny_gemma3, tiny_llama, tiny_mistral  # noqa: E402

from kvtier.engine import Engine, SamplingParams, spec_from_hf_config  # noqa: E402
from kvtier.engine.batch import kvtier_attention  # noqa: E402
from kvtier.engine.hf import layer_windows  # noqa: E402
from kvtier.errors import SpecError  # noqa: E402
from kvtier.spec import BufferKind  # noqa: E402

VOCAB = 256
WINDOW = 8
MODELS = {"gemma2": tiny_gemma2, "gemma3": tiny_gemma3, "mistral": tiny_mistral}

_models: dict[tuple, torch.nn.Module] = {}
_refs: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def model_of(name: str, **kw) -> torch.nn.Module:
    key = (name, *sorted(kw.items()))
    if key not in _models:
        _models[key] = MODELS[name](**kw)
    return _models[key]


# Gemma 2 (soft-capped sliding attention) is refused below transformers 5.24 (`layer_windows`).
OLD_TRANSFORMERS = Version(transformers.__version__).release < (5, 24)
needs_new = pytest.mark.skipif(OLD_TRANSFORMERS, reason="Gemma 2 needs transformers >= 5.24")


@pytest.fixture(params=[pytest.param(n, marks=needs_new) if n == "gemma2" else n for n in MODELS])
def name(request) -> str:
    return request.param


@pytest.mark.skipif(not OLD_TRANSFORMERS, reason="transformers >= 5.24 serves Gemma 2")
def test_gemma2_is_refused_below_transformers_5_24() -> None:
    with pytest.raises(SpecError, match=r"5\.24"):
        layer_windows(model_of("gemma2").config)


def reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of plain forwards over the whole sequence (no cache), and the first one's logits."""
    key = (id(model), tuple(prompt), n)
    if key not in _refs:
        seq, first = list(prompt), None
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([seq])).logits[0, -1]
                first = logits if first is None else first
                seq.append(int(logits.argmax()))
        _refs[key] = seq[len(prompt) :], first
    return _refs[key]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_generates(model, result, prompt: list[int], n: int) -> None:
    """The engine's tokens are the plain greedy ones, its first logits theirs, and `generate`'s up to EOS."""
    tokens, logits = reference(model, prompt, n)
    assert result.tokens == tokens, (len(prompt), result.tokens, tokens)
    assert rel(result.first_logits, logits) < 1e-5
    ids = torch.tensor([prompt])
    with torch.no_grad():  # a mask of ones: `generate` would take Gemma's pad id 0 in a prompt for padding
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    assert result.tokens[: gen.shape[1] - len(prompt)] == gen[0, len(prompt) :].tolist()


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompts(seed: int, lengths: list[int], shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB, (shared,), generator=gen).tolist()
    return [head + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_sliding_configs_map_to_full_kv_rows_and_per_layer_windows() -> None:
    for name in ("gemma3",) if OLD_TRANSFORMERS else ("gemma2", "gemma3"):
        config = model_of(name).config
        spec = spec_from_hf_config(config, dtype=torch.float32)
        assert [b.kind for b in spec.buffers] == [BufferKind.K, BufferKind.V]
        assert spec.num_layers == 4 and spec.buffers[0].row_shape == (2, 16)
        assert layer_windows(config) == (WINDOW, None, WINDOW, None)
    assert layer_windows(model_of("mistral").config) == (WINDOW, WINDOW)  # no layer_types: every layer
    assert layer_windows(tiny_llama().config) == (None, None)
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=512)  # Gemma 3's 5:1 pattern
    assert layer_windows(gemma3) == (512,) * 5 + (None, 512)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer_types": ["full_attention", "linear_attention"]}, "linear_attention"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"layer_types": ["full_attention"]}, "over 1 of 2 layers"),
        (
            {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": None},
            "sliding_window None",
        ),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 0}, "sliding_window 0"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_configs_kvtier_cannot_serve_are_refused(change, message) -> None:
    config = transformers.Gemma3TextConfig(num_hidden_layers=2)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(SpecError, match=message):
        spec_from_hf_config(config)
    with pytest.raises(SpecError, match=message):
        layer_windows(config)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cold_device_hit_and_host_round_trip_give_generates_tokens(name, page_size) -> None:
    model = model_of(name)
    eng = Engine(model, device_tokens=256, host_tokens=1024, page_size=page_size)
    first, tail = prompts(1, [41, 13])
    cold = eng.generate(first, params(8))
    assert cold.hit == "none"
    assert_generates(model, cold, first, 8)

    again = eng.generate(first, params(8))
    assert again.device_hit_tokens >= len(first) - page_size
    assert_generates(model, again, first, 8)

    second = first + cold.tokens + tail  # a second turn: its new piece's windows reach into the cached prefix
    hit = eng.generate(second, params(8))
    assert hit.device_hit_tokens >= len(first) - page_size
    assert_generates(model, hit, second, 8)

    for _ in range(2):
        eng.cache.flush()
        eng.cache.evict_device(10**6)  # everything to the host
        back = eng.generate(second, params(8))
        assert back.hit == "host" and back.loaded_tokens >= len(second) - page_size
        assert_generates(model, back, second, 8)
    eng.cache.flush()
    eng.cache.check_invariants()


def test_batched_mixed_lengths_with_decodes_and_prefill_pieces_in_one_step(name) -> None:
    model = model_of(name)
    eng = Engine(model, device_tokens=1024, host_tokens=1024, max_num_batched_tokens=16, max_num_seqs=8)
    ps = prompts(2, [20, 57, 33, 3]) + prompts(3, [9, 26], shared=24)
    early = eng.submit(ps[0], params(10))
    results, got = {}, []
    while not early.tokens:  # prefilling in pieces of 16, then its first token
        got += eng.step()
    late = [eng.submit(p, params(10)) for p in ps[1:]]
    updates = eng.step()
    # The early request decoded in the step that computed the first late one's first piece.
    assert eng.num_running >= 2 and ps[1] == late[0].prompt.tolist()
    assert [u.request for u in updates if u.token is not None] == [early]
    got += updates
    while eng.busy:
        got += eng.step()
    for u in got:
        assert u.error is None
        if u.result is not None:
            results[u.request.id] = u.result
    for req, p in zip([early, *late], ps, strict=True):
        assert_generates(model, results[req.id], p, 10)
    eng.cache.flush()
    eng.cache.check_invariants()
    assert not eng.cache.active_leases()


def test_the_window_and_the_softcap_decide_the_logits(name) -> None:
    """Same weights, another window (or no cap): other logits; the engine's are those of the model's own."""
    model = model_of(name)
    prompt = prompts(4, [37])[0]
    eng = Engine(model, device_tokens=256, host_tokens=256, max_num_batched_tokens=12)
    result = eng.generate(prompt, params(8))
    assert_generates(model, result, prompt, 8)
    others = [model_of(name, window=w) for w in (WINDOW - 1, WINDOW + 1, 4096)]
    if name == "gemma2":
        others.append(model_of(name, softcap=None))
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
        other_logits = reference(other, prompt, 8)[1]
        assert rel(result.first_logits, other_logits) > 1e-3, other.config  # the model's own: < 1e-5
    assert result.tokens != reference(others[2], prompt, 8)[0]  # with the window ignored


def test_outside_a_step_kvtier_attention_is_the_models_own(name) -> None:
    """A model switched to `"kvtier"` attention with no step active: its own logits and tokens."""
    model = model_of(name)
    prompt = torch.tensor(prompts(5, [30]))
    gen = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": 8,
        "do_sample": False,
        "min_new_tokens": 8,
    }
    with torch.no_grad():
        own = model(prompt).logits
        own_tokens = model.generate(prompt, **gen)
        with kvtier_attention(model.config):
            switched = model(prompt).logits
            switched_tokens = model.generate(prompt, **gen)
    assert rel(switched, own) < 1e-5
    assert torch.equal(switched_tokens, own_tokens)


@pytest.mark.parametrize("name", [pytest.param("gemma2", marks=needs_new), "gemma3"])
def test_served_through_the_openai_client_with_generates_answer(name) -> None:
    """`kvtier serve`'s app over a tiny Gemma: the chat answer is the text of `generate`'s tokens."""
    for needed in ("fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
        pytest.importorskip(needed)
    import openai
    from served import MESSAGES, MODEL, serving, tiny_tokenizer

    from kvtier.server.app import create_app

    tokenizer = tiny_tokenizer()
    prompt = torch.tensor([tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]])
    models, answers = {}, {}
    for window in (4, 4096):  # the chat's prompt is 47 tokens: the window of 4 decides the answer
        models[window] = model = MODELS[name](len(tokenizer), 256, window=window)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        with torch.no_grad():
            ids = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False
            )
        answers[window] = tokenizer.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True)
    expected = answers[4]
    assert expected != answers[4096]
    engine = Engine(models[4], tokenizer, device_tokens=512, host_tokens=1024)
    with serving(create_app(engine, MODEL)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(2):  # cold, then from the cache
            answer = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
            )
            assert answer.choices[0].message.content == expected
    assert engine.closed
