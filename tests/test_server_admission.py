"""Admission and overload in `kvtier serve`'s routes: 413, 429 with Retry-After, 504, `/health` under load.

Each test serves an app of its own (uvicorn in a thread, tests/served.py) over the tiny
random model, whose greedy answers run to `max_tokens` (eos is never its argmax here), so
a long request keeps the engine busy for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
from served import MESSAGES, MODEL, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

LIMIT = 4096  # bytes of body the admission tests' servers take
CHAT = "/v1/chat/completions"


def engine(**kw) -> Engine:
    tokenizer = tiny_tokenizer()
    return Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=2048, **kw)


def body(max_tokens: int = 4, **kw) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **kw}


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    return err


@pytest.fixture(scope="module")
def small():
    """A server taking bodies of at most `LIMIT` bytes."""
    with serving(create_app(engine(), MODEL, max_body_bytes=LIMIT)) as base:
        yield base


class Stream:
    """A long streamed chat read on a thread of its own: `started` once its first token came."""

    def __init__(self, base: str, max_tokens: int = 200) -> None:
        self.base, self.max_tokens = base, max_tokens
        self.started, self.stop = threading.Event(), threading.Event()
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the long stream never produced a token"

    def _read(self) -> None:
        with httpx.stream("POST", self.base + CHAT, json=body(self.max_tokens, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                    self.lines.append(line)
                    self.started.set()
                if self.stop.is_set():
                    return  # leave with the stream still running: the worker cancels it

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_an_oversize_content_length_is_answered_413_before_the_body_is_read(small) -> None:
    """The request says 1 GB and sends nothing more: the answer cannot have waited for the body."""
    host, port = small.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {10**9}\r\n\r\n{{".encode()
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)  # times out (fails) if the server waits for the body
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    err = json.loads(payload)["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]
    assert httpx.post(small + CHAT, json=body()).status_code == 200  # the server keeps serving


def test_a_chunked_body_that_grows_past_the_limit_is_answered_413(small) -> None:
    sent = []

    def chunks(n: int, size: int = 1024):
        for _ in range(n):
            sent.append(size)
            yield b" " * size

    r = httpx.post(small + CHAT, content=chunks(16), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers  # sent chunked: only reading can tell its size
    assert_openai_error(r, 413, "request_too_large")
    # A chunked body under the limit is read whole and served.
    raw = json.dumps(body()).encode()
    padded = raw + b" " * (LIMIT - len(raw))
    ok = httpx.post(small + CHAT, content=iter([padded[:1000], padded[1000:]]))
    assert ok.status_code == 200, ok.text


def test_a_full_queue_is_answered_429_with_retry_after() -> None:
    """One request runs, at most one waits: of a burst behind them, at least one gets 429."""
    app = create_app(engine(max_num_seqs=1), MODEL, max_queue=1)
    with serving(app) as base:
        long = Stream(base)
        try:
            with ThreadPoolExecutor(6) as pool:
                replies = list(pool.map(lambda _: httpx.post(base + CHAT, json=body(), timeout=60), range(6)))
        finally:
            long.close()
        refused = [r for r in replies if r.status_code == 429]
        assert refused and all(r.status_code in (200, 429) for r in replies), [r.status_code for r in replies]
        for r in refused:
            err = assert_openai_error(r, 429, "queue_full")
            assert err["type"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
        metrics = httpx.get(base + "/metrics").text
        assert f'kvtier_requests_total{{status="429"}} {float(len(refused))}' in metrics
        assert httpx.post(base + CHAT, json=body()).status_code == 200  # served again once the queue drains


def test_health_answers_while_a_long_generation_runs() -> None:
    with serving(create_app(engine(), MODEL)) as base:
        long = Stream(base)
        try:
            assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
            seen = len(long.lines)
            deadline = time.monotonic() + 30
            while len(long.lines) == seen and time.monotonic() < deadline:
                time.sleep(0.05)
            # The stream went on after /health answered: it was answered during the generation.
            assert len(long.lines) > seen
        finally:
            long.close()


def test_parsing_and_tokenisation_run_off_the_event_loop() -> None:
    """The routes' tokenisation runs where no event loop is running (a thread of its own)."""
    eng = engine()
    on_loop = []

    def spy(encode):
        def wrapped(*args, **kw):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return encode(*args, **kw)

        return wrapped

    eng.encode_chat = spy(eng.encode_chat)
    eng.tokenizer.encode = spy(eng.tokenizer.encode)
    with serving(create_app(eng, MODEL)) as base:
        assert httpx.post(base + CHAT, json=body()).status_code == 200
        text = {"model": MODEL, "prompt": "the lazy dog", "max_tokens": 2, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=text).status_code == 200
    assert on_loop == [False, False]


def test_a_request_past_its_timeout_is_answered_504() -> None:
    """Non-streamed: 504 in OpenAI's shape; streamed: an error event, then `[DONE]` (the batched engine
    ends a request past `SamplingParams.timeout_s` with finish_reason "timeout")."""
    with serving(create_app(engine(), MODEL, request_timeout_s=0.05)) as base:
        r = httpx.post(base + CHAT, json=body(200), timeout=60)  # 200 tokens: far longer than 50 ms
        err = assert_openai_error(r, 504, "request_timeout")
        assert "0.05 s" in err["message"]
        with httpx.stream("POST", base + CHAT, json=body(200, stream=True), timeout=60) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        metrics = httpx.get(base + "/metrics").text
        assert 'kvtier_requests_total{status="504"} 2.0' in metrics


@pytest.mark.parametrize(
    "kw",
    [
        {"max_queue": 0},
        {"max_body_bytes": 0},
        {"request_timeout_s": 0},
        {"request_timeout_s": -1.0},
        {"body_timeout_s": 0},
    ],
)
def test_limits_that_are_not_positive_are_refused(kw) -> None:
    with engine() as eng, pytest.raises(ConfigError, match="must be positive"):
        create_app(eng, MODEL, **kw)
