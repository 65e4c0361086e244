"""The engine over a storage tier: a Redis server killed and back mid-run, restarts and a size cap on disk.

Every answer is compared with a cold engine's (no storage, the prompt never seen): a
storage hit, a fault or an eviction may change where a prefix comes from, never a token.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

pytest.importorskip("transformers")

from tiny_models import tiny_llama

from kvtier.engine import Engine, RequestResult, SamplingParams
from kvtier.errors import ConfigError
from kvtier.storage.config import StorageConfig

DEVICE_TOKENS, HOST_TOKENS = 512, 2048
PARAMS = SamplingParams(max_tokens=6)
# One token per page, so a page count is a token count below (the default with storage is
# 64; tests/test_cache_storage.py covers pages of several tokens).
PAGE = 1


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def cold(model):
    """`cold(prompt)`: the answer of an engine without storage that has never seen the prompt."""
    answers: dict[tuple[int, ...], RequestResult] = {}

    def cold_(prompt: list[int]) -> RequestResult:
        if tuple(prompt) not in answers:
            with Engine(model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS) as eng:
                answers[tuple(prompt)] = eng.generate(prompt, PARAMS)
            assert answers[tuple(prompt)].hit == "none"
        return answers[tuple(prompt)]

    return cold_


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` random prompts of `length` ids that share no first token (hence no prefix)."""
    rng = np.random.default_rng(seed)
    firsts = rng.choice(np.arange(3, 256), n, replace=False)
    return [[int(f), *rng.integers(3, 256, length - 1).tolist()] for f in firsts]


def assert_same(got: RequestResult, want: RequestResult) -> None:
    assert got.tokens == want.tokens
    rel = (got.first_logits - want.first_logits).norm() / want.first_logits.norm()
    assert rel < 1e-5, rel


def evict_all(eng: Engine) -> None:
    """Push every prefix out of the device and the host (storage writes finished first)."""
    eng.cache.flush()
    eng.cache.evict_device(10**9)
    eng.cache.evict_host(10**9)
    eng.cache.check_invariants()
    assert eng.cache.tree.nodes() == []


def counts(eng: Engine) -> dict:
    return eng.storage.metrics.snapshot()


# -- Redis killed mid-run ------------------------------------------------------------------------


def test_redis_killed_mid_run_recomputes_counts_errors_then_reconnects(
    redis_server_factory, model, cold
) -> None:
    server = redis_server_factory()
    config = StorageConfig(server.url, timeout_s=0.5, model=f"killed-{uuid.uuid4().hex}")
    first, *others = prompts(40, 40, seed=1)
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=PAGE, storage=config
    ) as eng:
        assert_same(eng.generate(first, PARAMS), cold(first))
        eng.cache.flush()
        before = counts(eng)
        assert before["pages_written"] >= len(first) and not any(before["errors"].values())

        server.kill()
        evict_all(eng)  # `first` is in storage only, and storage is gone
        again = eng.generate(first, PARAMS)
        assert again.hit == "none" and again.storage_hit_tokens == 0  # recomputed
        assert_same(again, cold(first))
        fresh = others.pop()
        assert_same(eng.generate(fresh, PARAMS), cold(fresh))
        eng.cache.flush()  # both write-through stores run and fail
        down = counts(eng)
        assert down["errors"]["exists"] >= 1 and down["errors"]["put"] >= 1
        assert down["pages_written"] == before["pages_written"]
        assert down["writes_failed"] >= len(fresh)
        eng.cache.check_invariants()

        server.start()  # the same port, empty: persistence is off
        deadline, written = time.monotonic() + 15, None
        while time.monotonic() < deadline:  # new prompts until the back-off lets a write through
            written = others.pop()
            assert_same(eng.generate(written, PARAMS), cold(written))
            eng.cache.flush()
            if counts(eng)["pages_written"] > down["pages_written"]:
                break
            time.sleep(0.5)
        up = counts(eng)
        assert up["pages_written"] >= down["pages_written"] + len(written), "no write after the restart"

        evict_all(eng)
        hit = eng.generate(written, PARAMS)  # read back by the same workers that saw the faults
        assert hit.hit == "storage" and hit.storage_hit_tokens == len(written) - 1
        assert_same(hit, cold(written))
        lost = eng.generate(first, PARAMS)  # written before the kill: the new server never had it
        assert lost.storage_hit_tokens == 0
        assert_same(lost, cold(first))
        after = counts(eng)
        assert after["pages_read"] >= len(written) - 1
        assert not any(after["rejected"].values())
        eng.cache.check_invariants()


# -- The file backend ----------------------------------------------------------------------------


def conversation(eng: Engine, turns: list[list[int]]) -> tuple[list[int], list[RequestResult]]:
    """Each turn's prompt is the previous prompt, its answer and the turn's new ids."""
    prompt: list[int] = []
    results = []
    for new in turns:
        prompt = prompt + (results[-1].tokens if results else []) + new
        results.append(eng.generate(prompt, PARAMS))
    return prompt, results


def test_a_conversation_comes_back_from_disk_after_a_restart(tmp_path, model, cold) -> None:
    url = f"file://{tmp_path / 'store'}"
    turns = prompts(4, 30, seed=2)
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=PAGE, storage=url
    ) as eng:
        last, results = conversation(eng, turns)
        assert [r.hit for r in results] == ["none", "device", "device", "device"]
    stored = counts(eng)["pages_written"]  # close() wrote what was still pending
    assert stored >= len(last)
    assert sum(1 for f in (tmp_path / "store").rglob("*") if f.is_file()) == stored

    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=PAGE, storage=url
    ) as again:
        back = again.generate(last, PARAMS)
        assert back.hit == "storage" and back.storage_hit_tokens == len(last) - 1
        assert_same(back, cold(last))
        m = counts(again)
        assert m["pages_read"] == len(last) - 1 and not any(m["rejected"].values())
        assert not any(m["errors"].values())


def test_the_size_cap_evicts_older_pages_and_answers_stay_right(tmp_path, model, cold) -> None:
    store = tmp_path / "store"
    asked = prompts(6, 40, seed=3)
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=PAGE, storage=f"file://{store}"
    ) as eng:
        eng.generate(asked[0], PARAMS)
        eng.cache.flush()
        m = counts(eng)
        page = m["bytes_written"] // m["pages_written"]  # one value: header and payload
    cap = 100 * page  # about two of the requests below
    config = StorageConfig(f"file://{tmp_path / 'capped'}", size_bytes=cap)
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=PAGE, storage=config
    ) as eng:
        backend = eng.storage.backend
        for prompt in asked:
            assert_same(eng.generate(prompt, PARAMS), cold(prompt))
            eng.cache.flush()
            on_disk = sum(f.stat().st_size for f in (tmp_path / "capped").rglob("*") if f.is_file())
            assert backend.usage()[1] == on_disk <= cap
        assert counts(eng)["pages_written"] > 100 and backend.evicted_values > 0
        assert backend.evicted_values == counts(eng)["pages_written"] - backend.usage()[0]

        evict_all(eng)
        newest = eng.generate(asked[-1], PARAMS)  # still under the cap
        assert newest.hit == "storage" and newest.storage_hit_tokens == len(asked[-1]) - 1
        assert_same(newest, cold(asked[-1]))
        oldest = eng.generate(asked[0], PARAMS)  # its pages were the first evicted
        assert oldest.storage_hit_tokens == 0
        assert_same(oldest, cold(asked[0]))
        m = counts(eng)
        assert not any(m["errors"].values()) and not any(m["rejected"].values())
        assert backend.usage()[1] <= cap


@pytest.mark.parametrize("page", [16, 64])
def test_pages_of_several_tokens_come_back_from_storage_with_the_same_tokens(
    model, cold, tmp_path, page
) -> None:
    """The default page with storage is 64 tokens: whole pages are kept, a page's tail recomputed."""
    url = f"file://{tmp_path / 'store'}"
    (prompt,) = prompts(1, 150, seed=7)
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=page, storage=url
    ) as eng:
        assert_same(eng.generate(prompt, PARAMS), cold(prompt))
    with Engine(
        model, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, page_size=page, storage=url
    ) as eng:
        again = eng.generate(prompt, PARAMS)
        assert again.hit == "storage" and again.storage_hit_tokens == (len(prompt) - 1) // page * page
        assert_same(again, cold(prompt))
        eng.cache.check_invariants()


def test_a_page_size_that_does_not_divide_the_pools_is_refused(model) -> None:
    with pytest.raises(ConfigError, match="multiples of the page size"):
        Engine(model, device_tokens=500, host_tokens=HOST_TOKENS, page_size=64)
