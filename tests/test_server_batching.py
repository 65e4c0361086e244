"""The server batches: concurrent clients share steps, and a client that leaves is dropped.

The official `openai` client (async, 16 streams at once) and httpx, against the app in
this process with the tiny random model.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import openai  # noqa: E402
from served import MESSAGES, MODEL, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    tokenizer = tiny_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=2048, host_tokens=2048, max_num_seqs=16)
    app = create_app(engine, MODEL)
    with serving(app) as base:
        yield base, engine, app, tokenizer


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"the quick brown fox number {i} jumps over the lazy dog"}]


def assert_nothing_held(engine: Engine) -> None:
    deadline = time.time() + 20
    while engine.busy and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.busy
    assert not engine.cache.active_leases() and len(engine.cache.held_slots()) == 0


def test_sixteen_concurrent_streams_share_steps_and_match_their_solo_answers(server) -> None:
    base, engine, _app, tokenizer = server

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=question(i), max_tokens=12, temperature=0, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()

    steps_before = engine.stats.generation_tokens
    answers = asyncio.run(all_of_them())
    assert all(finish in ("stop", "length") for _, finish in answers)
    assert engine.stats.generation_tokens > steps_before
    # Each answer is the one the same request gets alone (greedy).
    solo_engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=512)
    for i, (text, _) in enumerate(answers):
        ids = solo_engine.encode_chat(question(i))
        alone = solo_engine.generate(ids, SamplingParams(max_tokens=12))
        assert text == alone.text, i
    solo_engine.close()
    assert_nothing_held(engine)


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server) -> None:
    base, engine, app, _ = server
    worker = app.state.worker
    cancelled = worker.cancelled
    # A long greedy answer that cannot end early: eos is never the argmax of this random model here.
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0})
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # a client that leaves
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        deadline = time.time() + 20
        while not engine.busy and time.time() < deadline:
            time.sleep(0.01)
        assert engine.busy  # it is generating: now the client goes away
    deadline = time.time() + 20
    while worker.cancelled == cancelled and time.time() < deadline:
        time.sleep(0.05)
    assert worker.cancelled == cancelled + 1
    assert engine.stats.finished.get("cancelled", 0) >= 1
    assert_nothing_held(engine)


def test_streamed_text_deltas_add_up_to_the_whole_answer(server) -> None:
    """`TextStream` decodes a window per token; its deltas add up to the whole decode."""
    from kvtier.server.protocol import TextStream

    tokenizer = server[3]
    gen = __import__("random").Random(3)
    for _ in range(20):
        tokens = [gen.randrange(len(tokenizer)) for _ in range(gen.randrange(1, 60))]
        decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        stream = TextStream(decode)
        text = "".join(stream.push(t) for t in tokens)
        whole = decode(tokens)
        assert text == stream.sent and whole.startswith(text)
        assert set(whole[len(text) :]) <= {"\ufffd"}  # held back: bytes of no whole character yet


def test_a_prompt_the_device_pool_cannot_hold_alone_is_a_400_and_evicts_nothing() -> None:
    """It fits the model's context (4096) but not the 256-slot pool: refused at admission, cache intact."""
    from tiny_models import tiny_llama

    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), 4096, eos_token_id=tokenizer.eos_token_id)
    engine = Engine(model, tokenizer, device_tokens=256, host_tokens=256)
    with serving(create_app(engine, MODEL)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        client.chat.completions.create(model=MODEL, messages=question(7), max_tokens=2, temperature=0)
        assert_nothing_held(engine)
        free = engine.cache.device_alloc.available()
        hits = engine.cache.metrics.device_hit_tokens
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=question(7), max_tokens=1000)
        assert e.value.status_code == 400 and "device" in e.value.message
        assert engine.cache.device_alloc.available() == free  # nothing was evicted for it
        again = client.chat.completions.create(model=MODEL, messages=question(7), max_tokens=2, temperature=0)
        assert again.choices[0].message.content is not None
        assert engine.cache.metrics.device_hit_tokens > hits  # the cached prefix is still there


class _DiesOnSubmit(Engine):
    """An engine whose `submit` raises what the worker cannot handle (a BaseException)."""

    def submit(self, prompt, params=None):
        raise SystemExit("injected")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # it dies, as meant
def test_a_worker_that_dies_is_logged_and_the_server_answers_503(caplog) -> None:
    tokenizer = tiny_tokenizer()
    engine = _DiesOnSubmit(tiny_model(tokenizer), tokenizer, device_tokens=256, host_tokens=256)
    with serving(create_app(engine, MODEL)) as base:
        assert httpx.get(base + "/health").status_code == 200
        body = {"model": MODEL, "messages": question(1), "max_tokens": 2}
        first = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 500  # the job in hand is answered, not left hanging
        deadline = time.time() + 10
        while httpx.get(base + "/health").status_code != 503 and time.time() < deadline:
            time.sleep(0.05)
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=30).status_code == 503
    assert any("worker stopped" in r.getMessage() for r in caplog.records)
