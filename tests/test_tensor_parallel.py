"""The engine over tensor-parallel ranks (gloo, 2 and 4 processes on the CPU): the same tokens as one
process and as `generate`, the same cache decisions on every rank, and the refusals."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import signal  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from served import tiny_tokenizer  # noqa: E402
from tiny_models import tiny_deepseek_v3, tiny_llama  # noqa: E402
from tp_ranks import counters, engine_rounds, engine_storage_restart, run_ranks  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.engine.hf import check_tp, spec_from_hf_config  # noqa: E402
from kvtier.engine.models import load_model  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402

SIZES = dict(device_tokens=128, host_tokens=1024)
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def _prompts(n: int, length: int = 50) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, 250, length).tolist() for _ in range(n)]


A, B, C = _prompts(3)
# Round 1 batches two requests; round 2 pushes some of their pages to the host; round 3 hits
# C on the device and A partly on the host.
ROUNDS = [[(A, GREEDY), (B, GREEDY)], [(C, GREEDY)], [(C, GREEDY), (A, GREEDY)]]


def _save(path, make) -> str:
    tokenizer = tiny_tokenizer()
    make(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama_kv2(tmp_path_factory) -> str:
    return _save(tmp_path_factory.mktemp("llama-kv2"), lambda t: tiny_llama(len(t), 256, kv_heads=2))


def _one_process(checkpoint: str, rounds) -> dict:
    """What one process's engine gives over `rounds`, with `generate`'s greedy tokens of each prompt."""
    model, tokenizer = load_model(checkpoint, "cpu", "float32")
    tokens, hits, generated = {}, {}, {}
    with Engine(model, tokenizer, **SIZES) as eng:
        for batch in rounds:
            reqs = [(eng.submit(p, params), p) for p, params in batch]
            while any(not r.finished for r, _ in reqs):
                for u in eng.step():
                    if u.result is not None:
                        tokens[u.request.id] = u.result.tokens
                        hits[u.request.id] = (u.result.device_hit_tokens, u.result.host_hit_tokens)
            for r, p in reqs:
                if r.params.temperature == 0:
                    out = model.generate(
                        torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
                    )
                    generated[r.id] = out[0, len(p) :].tolist()
        metrics = counters(eng.cache.metrics)
    return {"tokens": tokens, "hits": hits, "generated": generated, "metrics": metrics}


def _check_against_one_process(ranks: list[dict], one: dict) -> None:
    lead = ranks[0]
    assert lead["tokens"] == one["tokens"] == one["generated"]
    assert lead["hits"] == one["hits"]  # the same cache decisions as one process
    last = [lead["hits"][i] for i in sorted(lead["hits"])[-2:]]
    assert any(d for d, _ in last) and any(h for _, h in last), last  # device and host hits
    for r in ranks[1:]:
        assert r["tokens"] == lead["tokens"]
        assert r["metrics"] == lead["metrics"]  # every rank matched, loaded and evicted alike


def test_two_ranks_generate_what_one_process_and_generate_do(llama_kv2: str) -> None:
    ranks = run_ranks(engine_rounds, 2, llama_kv2, ROUNDS, SIZES)
    _check_against_one_process(ranks, _one_process(llama_kv2, ROUNDS))
    assert [r["spec"] for r in ranks] == [("k", (1, 16))] * 2  # one of the 2 K/V heads on each rank


def test_four_ranks_split_four_kv_heads_and_generate_the_same_tokens(tmp_path) -> None:
    path = _save(tmp_path / "llama-kv4", lambda t: tiny_llama(len(t), 256, kv_heads=4))
    rounds = ROUNDS[:2]
    ranks = run_ranks(engine_rounds, 4, path, rounds, SIZES)
    one = _one_process(path, rounds)
    assert ranks[0]["tokens"] == one["tokens"] == one["generated"]
    assert all(r["tokens"] == ranks[0]["tokens"] and r["metrics"] == ranks[0]["metrics"] for r in ranks)
    assert {r["spec"] for r in ranks} == {("k", (1, 16))}


def test_mla_keeps_the_whole_latent_on_every_rank_and_generates_the_same_tokens(tmp_path) -> None:
    path = _save(tmp_path / "deepseek", lambda t: tiny_deepseek_v3(len(t), 256))
    ranks = run_ranks(engine_rounds, 2, path, ROUNDS, SIZES)
    _check_against_one_process(ranks, _one_process(path, ROUNDS))
    assert [r["spec"] for r in ranks] == [("kv", (40,))] * 2  # latent 32 + rope 8, whole


def test_sampled_tokens_are_rank_zeros_on_every_rank(llama_kv2: str) -> None:
    hot = SamplingParams(max_tokens=8, temperature=1.5, ignore_eos=True)  # unseeded: each rank would differ
    ranks = run_ranks(engine_rounds, 2, llama_kv2, [[(A, hot), (B, hot)]], SIZES)
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and len(ranks[0]["tokens"]) == 2


def test_heads_the_ranks_cannot_split_are_refused_before_anything_loads(llama_kv2: str) -> None:
    config = transformers.AutoConfig.from_pretrained(llama_kv2)
    with pytest.raises(ConfigError, match=r"cannot split 'llama'.s 4 query and 2 K/V heads"):
        check_tp(config, 4)
    assert spec_from_hf_config(config, tp=2).buffers[0].row_shape == (1, 16)
    mla = tiny_deepseek_v3().config
    assert spec_from_hf_config(mla, tp=4) == spec_from_hf_config(mla)  # any rank count: latent whole


def test_a_model_not_sharded_over_the_group_is_refused_before_pools_are_built() -> None:
    from kvtier.cache.ranks import RankGroup

    with pytest.raises(ConfigError, match="sharded over 1 ranks, the group has 2"):
        Engine(tiny_llama(), ranks=RankGroup(rank=0, world=2), **SIZES)


@pytest.mark.parametrize(
    ("flags", "code", "says"),
    [
        (["--tp", "3"], 2, "3 tensor-parallel ranks cannot split 'llama'"),
        (["--tp", "2", "--device", "cuda:0"], 1 if not torch.cuda.is_available() else 2, "--device cuda:0"),
    ],
)
def test_a_tp_the_machine_or_model_refuses_is_one_line_before_anything_loads(
    checkpoint, flags, code, says, capsys
) -> None:
    from redis_servers import free_port

    from kvtier.cli import main

    assert main(["serve", "--model", str(checkpoint), "--port", str(free_port()), *flags]) == code
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_tp_that_is_not_a_positive_int_is_a_usage_error(capsys) -> None:
    from kvtier.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--tp", "0"])
    assert exit_.value.code == 2 and "--tp: expected a positive integer, got 0" in capsys.readouterr().err


def test_serve_tp_2_answers_the_openai_client_with_one_process_tokens(checkpoint, served) -> None:
    pytest.importorskip("openai")
    from served import MESSAGES, tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    ids = list(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    want = tiny_model(tokenizer).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    want_text = tokenizer.decode(want[0, len(ids) :], skip_special_tokens=True)
    server = served.start(checkpoint, "--tp", "2")
    first = server.chat(max_tokens=8)
    again = server.chat(max_tokens=8)  # its prompt now hits the prefix cache
    assert first.choices[0].message.content == again.choices[0].message.content
    assert want_text.startswith(first.choices[0].message.content)
    assert server.metrics()['kvtier_cache_prompt_tokens_total{tier="device"}'] > 0
    code, out, _ = server.stop(signal.SIGTERM)  # rank 0 closes its engine, rank 1 follows it out
    assert code == 0 and "stopped" in out


def test_mla_pages_are_written_to_storage_once_and_every_rank_reads_them_after_a_restart(tmp_path) -> None:
    path = _save(tmp_path / "deepseek", lambda t: tiny_deepseek_v3(len(t), 256))
    store = tmp_path / "store"
    ranks = run_ranks(engine_storage_restart, 2, path, str(store), A, GREEDY)
    first, again = ranks[0]["results"]
    assert first[1] == "none" and again[1] == "storage" and again[2] == len(A) - 1
    (generated,) = _one_process(path, [[(A, GREEDY)]])["generated"].values()
    assert again[0] == first[0] == generated
    written = [r["written"][0] for r in ranks]
    assert written[0] > 0 and written[1:] == [0]  # rank 0 alone writes the latent every rank holds
    assert len([f for f in store.rglob("*") if f.is_file() and not f.name.startswith(".")]) == written[0]
    assert [r["hit_tokens"][1] for r in ranks] == [len(A) - 1] * 2  # both ranks read them
