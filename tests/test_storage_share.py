"""Servers sharing one store: two `kvtier serve` processes over one Redis and over a Redis Cluster.

The first server computes a conversation and, idle, writes its pages; the second (its own
device and host tiers, empty) finds them in storage and answers with the first's tokens.
Every test namespaces its keys by a `--storage-model` of its own: the session's Redis
servers are shared.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

from fastapi.testclient import TestClient  # noqa: E402
from served import MESSAGES, MODEL, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

CONVERSATION = [
    *MESSAGES,
    {"role": "assistant", "content": "the lazy dog sleeps in host memory"},
    {"role": "user", "content": "kvtier keeps prefixes: the quick brown fox jumps again"},
]
STORAGE_TIER = 'kvtier_cache_prompt_tokens_total{tier="storage"}'


@pytest.fixture(params=["redis", "redis+cluster"])
def store_url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "redis" else "redis_cluster_url")


def wait_for(what: str, ready: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s")
        time.sleep(0.1)


def assert_no_storage_faults(got: dict[str, float]) -> None:
    for op in ("exists", "get", "put"):
        assert got[f'kvtier_storage_errors_total{{op="{op}"}}'] == 0, op
    assert not {n: v for n, v in got.items() if n.startswith("kvtier_storage_rejected_total") and v}


def test_a_second_server_answers_from_the_pages_the_first_wrote(checkpoint, served, store_url) -> None:
    flags = ("--storage", store_url, "--storage-model", f"share-{uuid.uuid4().hex}", "--page-size", "1")
    first = served.start(checkpoint, *flags, ready=False)
    second = served.start(checkpoint, *flags, ready=False)  # both load their model at once
    first.ready()
    second.ready()

    cold = first.chat(CONVERSATION)
    prompt = cold.usage.prompt_tokens
    assert prompt > 20 and first.metrics()[STORAGE_TIER] == 0

    def written() -> bool:  # no request reaches the first server again: its idle worker writes them
        got = first.metrics()
        return (
            got["kvtier_storage_pages_written_total"] >= prompt and got["kvtier_storage_write_seconds_count"]
        )

    wait_for("the first server's pages in storage", written)

    warm = second.chat(CONVERSATION)
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.choices[0].finish_reason == cold.choices[0].finish_reason
    assert warm.usage.completion_tokens == cold.usage.completion_tokens
    got = second.metrics()
    # Page size 1: the whole prompt but its last token (always computed) comes from storage.
    assert 0 < got[STORAGE_TIER] <= prompt - 1
    assert got['kvtier_cache_prompt_tokens_total{tier="device"}'] == 0
    assert got['kvtier_cache_prompt_tokens_total{tier="host"}'] == 0
    assert got["kvtier_storage_pages_read_total"] == got[STORAGE_TIER]
    assert got["kvtier_storage_bytes_read_total"] > 0
    assert_no_storage_faults(got)
    assert_no_storage_faults(first.metrics())


def test_an_idle_server_writes_its_pages_without_another_request(tmp_path) -> None:
    """Write-through pages reach storage while the server idles, not at its next request or exit.

    Backups on the CPU run only when waited for, and their storage writes start only when a
    backup completes: without the worker settling the cache between requests, a server that
    answered once and then idled wrote nothing a second server could read.
    """
    tokenizer = tiny_tokenizer()
    engine = Engine(
        tiny_model(tokenizer),
        tokenizer,
        device_tokens=512,
        host_tokens=2048,
        page_size=1,
        storage=f"file://{tmp_path}",
    )
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(engine, MODEL)) as http:
        reply = http.post("/v1/chat/completions", json=body).json()
        prompt = reply["usage"]["prompt_tokens"]
        wait_for(
            "pages written while idle",
            lambda: engine.storage.metrics.snapshot()["pages_written"] >= prompt,
            timeout=15,
        )
        assert sum(1 for f in tmp_path.rglob("*") if f.is_file()) >= prompt
    assert engine.closed
