"""The engine's paged path (`PagedStep`, kernels reading the pool in place) and its CUDA graphs give
the reference path's tokens (`StepBatch`: contexts gathered, SDPA), greedy, in fp32.

On the CPU the paged kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
Triton is imported), tiny models, a few steps; on a GPU the same checks run compiled, and the
graph tests (graphs on against `enforce_eager`, and the step's one synchronisation) run too.
"""

from __future__ import annotations

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

from tiny_models import tiny_deepseek_v3, tiny_dsa, tiny_gemma2, tiny_gemma3, tiny_llama, tiny_mistral  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.hf import _transformers  # noqa: E402
from kvtier.engine.indexer import standin_rows  # noqa: E402
from kvtier.engine.paged import runs_on  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not runs_on(DEVICE):  # pragma: no cover - depends on the environment
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

MODELS = {
    "gqa": lambda: tiny_llama(kv_heads=1),
    "mha": lambda: tiny_llama(kv_heads=4),
    "mla": tiny_deepseek_v3,
    "mistral-window": tiny_mistral,
    "gemma3-window": tiny_gemma3,
    "gemma2-softcap": tiny_gemma2,
}


def build(name: str):
    if name == "gemma2-softcap" and _transformers() < (5, 24):
        pytest.skip("kvtier serves Gemma 2's soft-capped sliding layers with transformers >= 5.24")
    return MODELS[name]().to(DEVICE)


def run(model, prompts, max_tokens: int = 6, **engine) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Every prompt at once (chunked prefill beside decodes) to the end: tokens, first logits, and
    the decode graphs captured."""
    eng = Engine(model, device_tokens=1024, host_tokens=2048, max_num_batched_tokens=24, **engine)
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        reqs = [eng.submit(p, params) for p in prompts]
        while eng.busy:
            eng.step()
        results = [eng.cancel(r) for r in reqs]
        captures = eng.runner.graphs.captures if eng.runner.graphs is not None else 0
        return [r.tokens for r in results], [r.first_logits for r in results], captures
    finally:
        eng.close()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(k),), generator=gen).tolist()
        for k in torch.randint(1, 40, (n,), generator=gen)
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_paged_attention_gives_the_reference_tokens(name: str) -> None:
    model = build(name)
    ps = prompts(3)
    ref_tokens, ref_logits, _ = run(model, ps, paged_attention=False)
    tokens, logits, _ = run(model, ps, paged_attention=True, enforce_eager=True)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        assert (got - want).norm() / want.norm() < 1e-4


def test_every_token_gets_its_own_indexer_row_through_the_paged_path_and_its_graphs() -> None:
    """A DSA model (dense: its forward can be captured) served by the paged path, decodes replaying
    CUDA graphs on a GPU: every token's row on every indexer layer, prompts and answers, is the
    stand-in of its position and id (a graph remakes the rows of each replay's tokens)."""
    model = tiny_dsa(dense=True).to(DEVICE)
    ps = prompts(3, seed=4)
    eng = Engine(model, device_tokens=1024, host_tokens=2048, max_num_batched_tokens=24)
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in ps]
        while eng.busy:
            eng.step()
        if CUDA:
            assert eng.runner.graphs is not None and eng.runner.graphs.captures >= 1
        eng.cache.flush()
        layers = eng.spec.buffer("indexer").layers
        for prompt, req in zip(ps, reqs, strict=True):
            tokens = prompt + req.tokens[:-1]  # (the last answer token has no KV yet)
            m = eng.cache.match(tokens)
            assert m.device_tokens == len(tokens)
            ids, at = torch.tensor(tokens, device=DEVICE), torch.arange(len(tokens), device=DEVICE)
            for layer in layers:
                got = eng.device_pool.layer("indexer", layer)[m.device_slots.to(DEVICE)]
                assert torch.equal(got, standin_rows(at, ids, layer)), layer
    finally:
        eng.close()


def run_in_two_waves(model, first, second, **engine) -> tuple[list[list[int]], int, list[int]]:
    """`first` to the end of their prefill (decode-only steps after), then `second` beside them, to
    the end: every request's tokens, the captures, and the slot-table widths of the graphs kept."""
    eng = Engine(model, device_tokens=1024, host_tokens=2048, max_num_batched_tokens=24, **engine)
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in first]
        for _ in range(12):  # 3 prompts of up to 40 tokens prefill in 5 steps at most
            eng.step()
        reqs += [eng.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in second]
        while eng.busy:
            eng.step()
        tokens = [eng.cancel(r).tokens for r in reqs]
        graphs = eng.runner.graphs
        if graphs is None:
            return tokens, 0, []
        return tokens, graphs.captures, sorted(g.width for g in graphs._graphs.values())
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_graphs_give_the_eager_tokens(name: str) -> None:
    """Buckets 1..8 and a bucket padded (3, 5, 6 requests), tables wider than the first capture."""
    model = build(name)
    ps = [*prompts(6, seed=2), list(range(200, 256)) * 6]  # one context past 256 slots
    eager, _, _ = run(model, ps, max_tokens=12, enforce_eager=True)
    graphed, _, captures = run(model, ps, max_tokens=12)
    assert graphed == eager
    if name in ("gqa", "mha"):  # (a model whose forward cannot be captured runs eagerly: the MoE)
        assert captures >= 1
    # Short contexts decode alone first (a graph with the narrowest table), then a context past 256
    # slots joins them: its bucket is captured with a wider table, and the tokens stay the eager ones.
    first, second = prompts(3, seed=3), [list(range(200, 256)) * 6]
    eager, _, _ = run_in_two_waves(model, first, second, enforce_eager=True)
    graphed, captures, widths = run_in_two_waves(model, first, second)
    assert graphed == eager
    if name in ("gqa", "mha"):  # the same bucket (4: 3 padded, then 4) captured again, wider
        assert captures >= 2 and widths[-1] >= 512, (captures, widths)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the synchronisation audit needs a GPU")
def test_a_decode_step_synchronises_once() -> None:
    """torch's sync debug mode warns at each host synchronisation: one per step (the sampled ids)."""
    model = build("gqa")
    eng = Engine(model, device_tokens=1024, host_tokens=2048)
    try:
        params = [
            SamplingParams(max_tokens=20, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3),
        ]
        for p, prompt in zip(params, prompts(2), strict=True):
            eng.submit(prompt, p)
        for _ in range(4):  # prefill, then decodes (graphs captured)
            eng.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(3):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (one more warning says the debug mode is a prototype: not a synchronisation)
        syncs = [w for w in seen if "called a synchronizing" in str(w.message)]
        assert len(syncs) <= 3, [str(w.message) for w in syncs]
    finally:
        eng.close()
