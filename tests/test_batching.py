"""Continuous batching: many requests in one forward give the tokens each gives alone, and the model's.

Tiny random GQA and MLA models in fp32; every batched run is compared with plain greedy
forwards of the model (no cache) and with the same request run alone through the engine;
`test_engine.py` compares the engine with `model.generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_models import tiny_deepseek_v3, tiny_llama  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.errors import PromptTooLongError  # noqa: E402

VOCAB = 256
MODELS = {"gqa": tiny_llama, "mla": tiny_deepseek_v3}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


_refs: dict[tuple, list[int]] = {}


def reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of plain forwards over the whole sequence, no cache, EOS not special (memoised).

    (Not `generate(min_new_tokens=n)`: that masks EOS, where the engine's `ignore_eos`
    keeps an EOS the model picks and goes on.)
    """
    key = (id(model), tuple(prompt), n)
    if key not in _refs:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        _refs[key] = seq[len(prompt) :]
    return _refs[key]


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_all(eng: Engine, reqs: list, joins: dict[int, list] | None = None) -> dict:
    """Step until every request finished; `joins[k]`: `(prompt, n)` submitted before step k."""
    joins = dict(joins or {})
    results, step = {}, 0
    while eng.busy or joins:
        for prompt, n in joins.pop(step, []):
            reqs.append(eng.submit(prompt, params(n)))
        for u in eng.step():
            if u.error is not None:
                raise u.error
            if u.result is not None:
                results[u.request.id] = u.result
        step += 1
        if step > 10_000:
            raise AssertionError("the engine did not finish")
    return results


def assert_nothing_held(eng: Engine) -> None:
    """No lease or held slot is left: evicting everything empties the device pool."""
    assert not eng.cache.active_leases()
    assert len(eng.cache.held_slots()) == 0
    eng.cache.flush()
    eng.cache.check_invariants()
    eng.cache.evict_device(10**9)
    assert eng.cache.device_alloc.available() == eng.device_pool.num_slots


def prompts(seed: int, lengths: list[int], shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB, (shared,), generator=gen).tolist()
    return [head + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_lengths_shared_prefixes_and_late_joins_give_generates_tokens(model, page_size) -> None:
    eng = Engine(model, device_tokens=1024, host_tokens=1024, page_size=page_size, max_num_batched_tokens=40)
    ps = prompts(1, [3, 29, 61, 10], shared=0) + prompts(2, [5, 17, 1], shared=23)
    reqs = [eng.submit(p, params(6)) for p in ps[:4]]
    late = {2: [(ps[4], 6), (ps[5], 9)], 7: [(ps[6], 5)]}  # joins while the first ones decode
    results = run_all(eng, reqs, late)
    by_prompt = {tuple(r.prompt.tolist()): results[r.id] for r in reqs}
    for p, n in [(p, 6) for p in ps[:5]] + [(ps[5], 9), (ps[6], 5)]:
        res = by_prompt[tuple(p)]
        assert res.tokens == reference(model, p, n), (len(p), res.tokens)
        assert res.finish_reason == "length"
        with torch.no_grad():  # `generate` stops at EOS, where `ignore_eos` goes on
            gen = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
        assert res.tokens[: len(gen)] == gen
    assert not eng.busy
    assert_nothing_held(eng)


def test_batched_equals_alone_and_a_second_round_hits_the_cache(model) -> None:
    ps = prompts(3, [12, 40, 7, 33, 20, 2])
    alone = Engine(model, device_tokens=512, host_tokens=512)
    solo = [alone.generate(p, params(8)).tokens for p in ps]
    eng = Engine(model, device_tokens=512, host_tokens=512, max_num_seqs=4)
    reqs = [eng.submit(p, params(8)) for p in ps]
    first = run_all(eng, reqs)
    assert [first[r.id].tokens for r in reqs] == solo
    again = [eng.submit(p, params(8)) for p in ps]
    second = run_all(eng, again)
    for r, p in zip(again, ps, strict=True):
        assert second[r.id].tokens == first[reqs[ps.index(p)].id].tokens
        assert second[r.id].device_hit_tokens >= len(p) - 1 or len(p) == 1
    assert_nothing_held(eng)


def test_a_prefix_being_computed_is_computed_once(model) -> None:
    """Two requests with one long prompt: the second waits for the first's prefill and reuses it."""
    p = prompts(4, [90])[0]
    eng = Engine(model, device_tokens=512, host_tokens=512, max_num_batched_tokens=32)
    a, b = eng.submit(p, params(4)), eng.submit([*p, 7, 8], params(4))
    results = run_all(eng, [a, b])
    assert results[a.id].device_hit_tokens == 0
    assert results[b.id].device_hit_tokens == len(p)  # the whole of a's prompt, none recomputed
    assert results[b.id].tokens == reference(model, [*p, 7, 8], 4)
    assert eng.cache.metrics.miss_tokens < 2 * len(p)
    assert_nothing_held(eng)


def test_preemption_under_memory_pressure_resumes_with_the_same_tokens(model) -> None:
    """Six requests that cannot all fit the device at once: some are preempted and resumed."""
    ps = prompts(5, [30, 26, 35, 28, 31, 33])
    eng = Engine(model, device_tokens=128, host_tokens=1024, max_num_batched_tokens=64)
    reqs = [eng.submit(p, params(14)) for p in ps]
    results = run_all(eng, reqs)
    assert eng.stats.preemptions > 0
    assert sum(res.preemptions for res in results.values()) == eng.stats.preemptions
    for r, p in zip(reqs, ps, strict=True):
        assert results[r.id].tokens == reference(model, p, 14)
    assert_nothing_held(eng)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_decode_step_takes_its_pages_in_one_allocation(model, page_size: int) -> None:
    """Decodes that need a page get it from one `alloc_device` call a step, each a distinct slot."""
    ps = prompts(6, [9, 12, 7, 10])
    eng = Engine(model, device_tokens=256, host_tokens=512, page_size=page_size)
    reqs = [eng.submit(p, params(9)) for p in ps]
    eng.step()  # every prompt in one step
    calls = []
    alloc = eng.cache.alloc_device
    eng.cache.alloc_device = lambda n: calls.append(n) or alloc(n)
    try:
        for _ in range(6):
            calls.clear()
            need = sum(r.computed + 1 > r.filled for r in reqs)
            eng.step()
            assert calls == ([need * page_size] if need else [])
            tables = np.concatenate([r.table[: r.filled] for r in reqs])
            assert len(np.unique(tables)) == len(tables)
    finally:
        del eng.cache.alloc_device
    results = run_all(eng, [])
    for r, p in zip(reqs, ps, strict=True):
        assert results[r.id].tokens == reference(model, p, 9)
    assert_nothing_held(eng)


def test_a_prompt_that_cannot_fit_alone_is_refused_before_the_cache_changes(model) -> None:
    eng = Engine(model, device_tokens=64, host_tokens=256)
    p = prompts(6, [20])[0]
    eng.generate(p, params(4))
    before = eng.cache.device_alloc.available()
    with pytest.raises(PromptTooLongError, match="64"):
        eng.submit(prompts(7, [60])[0], params(8))
    assert eng.cache.device_alloc.available() == before and not eng.busy
    assert eng.generate(p, params(4)).device_hit_tokens == len(p) - 1  # nothing was evicted


def test_cancel_frees_everything_and_keeps_what_was_computed(model) -> None:
    ps = prompts(8, [40, 25, 33])
    eng = Engine(model, device_tokens=512, host_tokens=512, max_num_batched_tokens=16)
    reqs = [eng.submit(p, params(30)) for p in ps]
    for _ in range(6):
        eng.step()
    waiting = eng.submit(prompts(9, [10])[0], params(4))
    gone = eng.cancel(reqs[0])  # mid-decode
    assert gone.finish_reason == "cancelled" and reqs[0].finished
    assert eng.cancel(reqs[0]).finish_reason == "cancelled"  # idempotent
    eng.cancel(waiting)  # never admitted
    rest = run_all(eng, reqs)
    for r, p in zip(reqs[1:], ps[1:], strict=True):
        assert rest[r.id].tokens == reference(model, p, 30)
    hit = eng.generate(ps[0] + gone.tokens, params(2))
    assert hit.device_hit_tokens >= len(ps[0])  # the cancelled request's computed KV was inserted
    assert_nothing_held(eng)


def test_timeout_finishes_a_request_and_frees_it(model) -> None:
    eng = Engine(model, device_tokens=512, host_tokens=512)
    req = eng.submit(prompts(10, [8])[0], SamplingParams(max_tokens=400, ignore_eos=True, timeout_s=0.05))
    results = run_all(eng, [req])
    assert results[req.id].finish_reason == "timeout"
    assert len(results[req.id].tokens) < 400
    assert_nothing_held(eng)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 6),  # step it arrives before
            st.integers(1, 30),  # prompt length
            st.integers(1, 8),  # tokens to generate
            st.integers(0, 3),  # shared-head choice (0: none)
            st.one_of(st.none(), st.integers(0, 10)),  # cancelled before this step
        ),
        min_size=1,
        max_size=7,
    ),
    device_tokens=st.sampled_from([64, 96, 256]),
)
def test_random_arrivals_and_cancellations_leave_nothing_held(arrivals, device_tokens) -> None:
    model = _gqa()
    eng = Engine(model, device_tokens=device_tokens, host_tokens=256, max_num_batched_tokens=24)
    heads = prompts(11, [0, 8, 16, 24])
    by_step: dict[int, list] = {}
    for at, length, n, head, cancel_at in arrivals:
        prompt = heads[head] + prompts(at * 97 + length, [length])[0]
        by_step.setdefault(at, []).append((prompt, n, cancel_at))
    live, results, step = [], {}, 0
    while eng.busy or any(k >= step for k in by_step):
        for prompt, n, cancel_at in by_step.get(step, []):
            live.append((eng.submit(prompt, params(n)), prompt, n, cancel_at))
        for req, _, _, cancel_at in live:
            if cancel_at is not None and cancel_at == step and not req.finished:
                results[req.id] = eng.cancel(req)
        for u in eng.step():
            assert u.error is None
            if u.result is not None:
                results[u.request.id] = u.result
        step += 1
        assert step < 2000
    for req, prompt, n, _ in live:
        res = results[req.id]
        if res.finish_reason == "length":
            assert res.tokens == reference(model, prompt, n)
        else:
            assert res.finish_reason == "cancelled"
            assert res.tokens == reference(model, prompt, n)[: len(res.tokens)]
    assert_nothing_held(eng)


_gqa_model = None


def _gqa():
    global _gqa_model
    if _gqa_model is None:
        _gqa_model = tiny_llama()
    return _gqa_model
