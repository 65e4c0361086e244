"""`kvtier serve` against clients that misbehave and a SIGTERM under load (issue 41, item 5).

Real HTTP over loopback sockets: raw sockets for the clients that stall or leave mid-upload,
the official openai client for the others; the app served in a thread (tests/served.py), or
`kvtier serve` as a process of its own for the shutdown.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import openai  # noqa: E402
from served import MESSAGES, MODEL, samples, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

CHAT = "/v1/chat/completions"


def engine() -> Engine:
    tokenizer = tiny_tokenizer()
    return Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=2048)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(base: str, max_tokens: int = 4):
    return client(base).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0
    )


def partial_upload(base: str, declared: int = 1000, sent: bytes = b'{"model": "tiny-') -> socket.socket:
    """A connection that sent a chat request's headers (a body of `declared` bytes) and `sent` of it."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def read_response(sock: socket.socket) -> str:
    """One whole HTTP response on `sock`: its head, then as many body bytes as it declares (a
    response may arrive in several segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [ln for ln in head.decode().split("\r\n") if ln.lower().startswith("content-length:")]
    want = int(lengths[0].split(":", 1)[1]) if lengths else 0
    while len(body) < want:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def requests_by_status(base: str) -> dict[str, float]:
    got = samples(httpx.get(base + "/metrics").text)
    prefix = 'kvtier_requests_total{status="'
    return {name[len(prefix) : -2]: v for name, v in got.items() if name.startswith(prefix)}


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_stalled_bodies_release_their_admission_slots_at_the_body_deadline() -> None:
    with serving(create_app(engine(), MODEL, max_queue=2, body_timeout_s=2.0)) as base:
        stalled = [partial_upload(base) for _ in range(2)]
        time.sleep(0.5)  # both are inside admission, reading their bodies
        with pytest.raises(openai.RateLimitError):  # every slot is held by a stalled upload
            chat(base)
        for sock in stalled:  # each answered 408 at its deadline
            head = read_response(sock)
            assert head.startswith("HTTP/1.1 408"), head
            assert '"code":"body_timeout"' in head.replace(" ", "")
            sock.close()
        assert chat(base).choices[0].finish_reason == "length"  # the slots are free again
        assert requests_by_status(base)["408"] == 2


def test_a_client_gone_mid_upload_is_one_log_line_and_a_499(caplog) -> None:
    caplog.set_level(logging.INFO)
    with serving(create_app(engine(), MODEL)) as base:
        sock = partial_upload(base, declared=1000, sent=b" " * 100)
        sock.close()
        assert wait_for(lambda: requests_by_status(base).get("499") == 1)
        assert chat(base).choices[0].finish_reason == "length"  # and the server serves on
        statuses = requests_by_status(base)
        assert not [s for s in statuses if s.startswith("5") and statuses[s]], statuses
    lines = [r for r in caplog.records if "mid-upload" in r.getMessage()]
    assert len(lines) == 1 and "100 bytes" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_stream_the_client_leaves_is_counted_499_not_200() -> None:
    with serving(create_app(engine(), MODEL)) as base:
        before = requests_by_status(base)
        stream = client(base).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0, stream=True
        )
        for i, _chunk in enumerate(stream):
            if i >= 3:
                break
        stream.close()  # leave with the stream still running
        assert wait_for(lambda: requests_by_status(base).get("499") == before.get("499", 0) + 1)
        assert requests_by_status(base)["200"] == before["200"]
        assert chat(base).choices[0].finish_reason == "length"
        assert requests_by_status(base)["200"] == before["200"] + 1


def test_sigterm_under_load_exits_within_the_shutdown_timeout(checkpoint: Path, served) -> None:
    """One request runs at a time and a dozen long ones wait: SIGTERM answers what is left 503 at the
    timeout instead of running the queue to its end, then the server flushes and exits 0."""
    timeout = 1.0
    server = served.start(checkpoint, "--max-num-seqs", "1", "--shutdown-timeout", str(timeout))
    outcomes: list[object] = []

    def ask() -> None:
        try:
            outcomes.append(chat(server.base, max_tokens=200).choices[0].finish_reason)
        except openai.APIStatusError as e:
            outcomes.append((e.status_code, e.body.get("code") if isinstance(e.body, dict) else None))
        except openai.APIConnectionError as e:
            outcomes.append(type(e).__name__)

    clients = [threading.Thread(target=ask, daemon=True) for _ in range(12)]
    for t in clients:
        t.start()
    queued = "kvtier_num_requests_waiting"
    assert wait_for(lambda: server.metrics().get(queued, 0) >= 6), server.metrics().get(queued)
    start = time.monotonic()
    code, _out, err = server.stop(signal.SIGTERM)
    took = time.monotonic() - start
    for t in clients:
        t.join(timeout=30)
    assert code == 0 and "Traceback" not in err, err
    assert took < timeout + 30, f"exit took {took:.1f} s"  # a liveness bound, not a speed claim
    assert len(outcomes) == 12
    shut = [o for o in outcomes if o == (503, "shutting_down")]
    assert len(shut) >= 6, outcomes  # the queue was cancelled, not run to its end
    assert set(outcomes) <= {"length", (503, "shutting_down")}, outcomes
    assert "requests cancelled at the deadline" in err
