"""`kvtier serve` against the official openai client, on 127.0.0.1, with a tiny random model.

Most tests run the app in this process; the storage tests run `kvtier serve` as a process
of its own, stopped by SIGTERM and by Ctrl-C, over a `file://` store that outlives it.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import openai  # noqa: E402
from served import (  # noqa: E402
    MESSAGES,
    MODEL,
    samples,
    serving,
    tiny_model,
    tiny_tokenizer,
)

from kvtier.engine import Engine  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    tokenizer = tiny_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=2048)
    app = create_app(engine, MODEL)
    with serving(app) as base:
        yield base, engine, app
    assert engine.closed  # the app's shutdown closed the engine it was given


@pytest.fixture
def client(server):
    base = server[0]
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_and_health(server, client) -> None:
    base = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_chat_completion_then_a_cache_hit(server, client) -> None:
    base = server[0]
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens >= 1 and first.usage.prompt_tokens > 5
    device_hits = metric(base, 'kvtier_cache_prompt_tokens_total{tier="device"}')
    second = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert (
        metric(base, 'kvtier_cache_prompt_tokens_total{tier="device"}')
        >= device_hits + first.usage.prompt_tokens - 1
    )
    assert metric(base, "kvtier_time_to_first_token_seconds_count") >= 2


def test_metrics_are_histograms_of_fixed_size(server, client) -> None:
    """Latencies are bucketed: a scrape has as many lines after many requests as after one."""
    base = server[0]
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    before = httpx.get(base + "/metrics").text.splitlines()
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    after = httpx.get(base + "/metrics").text.splitlines()
    assert len(after) == len(before)
    for name in (
        "kvtier_time_to_first_token_seconds",
        "kvtier_e2e_request_latency_seconds",
        "kvtier_cache_load_seconds",
    ):
        assert f"# TYPE {name} histogram" in after
        buckets = [line for line in after if line.startswith(name + "_bucket{")]
        counts = [float(line.rsplit(" ", 1)[1]) for line in buckets]
        assert buckets[-1].startswith(name + '_bucket{le="+Inf"}')
        assert counts == sorted(counts)  # cumulative
        assert counts[-1] == metric(base, name + "_count")
    assert (
        metric(base, "kvtier_e2e_request_latency_seconds_count")
        >= metric(base, "kvtier_time_to_first_token_seconds_count")
        >= 4
    )


# Every family /metrics has without a storage tier, by the name prometheus-client's parser gives it
# (a counter's without `_total`), and its type.
FAMILIES = {
    "kvtier_num_requests_running": "gauge",
    "kvtier_num_requests_waiting": "gauge",
    "kvtier_time_to_first_token_seconds": "histogram",
    "kvtier_inter_token_latency_seconds": "histogram",
    "kvtier_e2e_request_latency_seconds": "histogram",
    "kvtier_prompt_tokens": "counter",
    "kvtier_generation_tokens": "counter",
    "kvtier_num_preemptions": "counter",
    "kvtier_requests": "counter",
    "kvtier_requests_finished": "counter",
    "kvtier_cache_matches": "counter",
    "kvtier_cache_prompt_tokens": "counter",
    "kvtier_cache_bytes": "counter",
    "kvtier_cache_loads": "counter",
    "kvtier_cache_loaded_tokens": "counter",
    "kvtier_cache_load_seconds": "histogram",
    "kvtier_cache_reload_gbps": "gauge",
    "kvtier_cache_evictions": "counter",
    "kvtier_cache_backups": "counter",
    "kvtier_cache_free_slots": "gauge",
    "kvtier_cache_free_runs": "gauge",
    "kvtier_cache_largest_free_run": "gauge",
}


def families(base: str) -> dict[str, dict]:
    """`/metrics` parsed by prometheus-client: family name -> {"type", "samples": {name{labels}: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(base + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    out = {}
    for f in text_string_to_metric_families(r.text):
        got = {}
        for s in f.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            got[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        out[f.name] = {"type": f.type, "samples": got}
    return out


def test_metrics_parse_as_prometheus_families_of_the_right_types_that_move(server, client) -> None:
    base = server[0]
    before = families(base)
    assert {name: before[name]["type"] for name in FAMILIES if name in before} == FAMILIES
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    after = families(base)

    def moved(family: str, sample: str) -> float:
        return after[family]["samples"][sample] - before[family]["samples"].get(sample, 0)

    assert moved("kvtier_requests", 'kvtier_requests_total{status="200"}') == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"kvtier_{h}", f"kvtier_{h}_count") == 1
        assert moved(f"kvtier_{h}", f'kvtier_{h}_bucket{{le="+Inf"}}') == 1
        assert moved(f"kvtier_{h}", f"kvtier_{h}_sum") > 0
    assert moved("kvtier_cache_matches", "kvtier_cache_matches_total") == 1
    tiers = [f'kvtier_cache_prompt_tokens_total{{tier="{t}"}}' for t in ("device", "host", "none")]
    # The last prompt token is always computed, so it is not counted in any tier.
    assert sum(moved("kvtier_cache_prompt_tokens", t) for t in tiers) == reply.usage.prompt_tokens - 1
    assert after["kvtier_num_requests_running"]["samples"]["kvtier_num_requests_running"] == 0
    assert after["kvtier_num_requests_waiting"]["samples"]["kvtier_num_requests_waiting"] == 0


def test_the_engine_counters_and_the_inter_token_latency_move(server, client) -> None:
    """Read from `engine.stats` and `RequestResult.token_times`, which the batched engine fills."""
    base = server[0]
    before = families(base)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    after = families(base)

    def moved(family: str, sample: str) -> float:
        return after[family]["samples"][sample] - before[family]["samples"].get(sample, 0)

    assert moved("kvtier_prompt_tokens", "kvtier_prompt_tokens_total") == reply.usage.prompt_tokens
    assert (
        moved("kvtier_generation_tokens", "kvtier_generation_tokens_total") == reply.usage.completion_tokens
    )
    itl = "kvtier_inter_token_latency_seconds"
    assert moved(itl, f"{itl}_count") == reply.usage.completion_tokens - 1
    reason = reply.choices[0].finish_reason
    assert moved("kvtier_requests_finished", f'kvtier_requests_finished_total{{reason="{reason}"}}') == 1
    assert after["kvtier_num_preemptions"]["samples"]["kvtier_num_preemptions_total"] == 0


def test_two_apps_in_one_process_keep_their_own_metrics(server) -> None:
    """Each app has a registry of its own: a second app starts at zero and does not clash."""
    tokenizer = tiny_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=64, host_tokens=128)
    with serving(create_app(engine, MODEL)) as other:
        got = families(other)
        assert got["kvtier_requests"]["samples"]['kvtier_requests_total{status="200"}'] == 0
        assert (
            got["kvtier_time_to_first_token_seconds"]["samples"]["kvtier_time_to_first_token_seconds_count"]
            == 0
        )
        assert got["kvtier_cache_free_slots"]["samples"]['kvtier_cache_free_slots{tier="device"}'] == 64
    assert (
        families(server[0])["kvtier_cache_free_slots"]["samples"]['kvtier_cache_free_slots{tier="device"}']
        > 64
    )


def test_without_storage_metrics_name_no_storage_tier(server, client) -> None:
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    names = samples(httpx.get(server[0] + "/metrics").text)
    assert 'kvtier_cache_prompt_tokens_total{tier="host"}' in names
    assert not [n for n in names if "storage" in n]


def test_streaming_chat_equals_the_non_streaming_answer(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    text, finish = "", None
    for chunk in chunks:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish in ("stop", "length")


def test_text_completions(client) -> None:
    out = client.completions.create(model=MODEL, prompt="the lazy dog", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and isinstance(out.choices[0].text, str)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (json.dumps({"messages": MESSAGES}).encode(), 400, "model"),
        (json.dumps({"model": "gpt-unknown", "messages": MESSAGES}).encode(), 404, "model"),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 9}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 1000}).encode(), 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server, client, body, status, param
) -> None:
    base, engine = server[0], server[1]
    r = httpx.post(base + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert ok.choices[0].message.content is not None
    engine.cache.flush()
    engine.cache.check_invariants()


def test_a_client_that_disconnects_mid_stream_leaves_no_lock(server) -> None:
    base, engine = server[0], server[1]
    worker = server[2].state.worker
    cancelled = worker.cancelled
    # A long greedy answer that cannot end early: eos is never the argmax of this random model here.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave with the stream still running
    deadline = time.time() + 20
    while worker.cancelled == cancelled and time.time() < deadline:
        time.sleep(0.05)
    assert worker.cancelled == cancelled + 1  # the worker stopped it: it did not just finish
    # Nothing is left locked or held: evicting everything empties the device pool.
    engine.cache.flush()
    engine.cache.check_invariants()
    engine.cache.evict_device(10**9)
    assert engine.cache.device_alloc.available() == engine.device_pool.num_slots


# -- `kvtier serve` as a process, over a file:// store ------------------------------------------


def test_sigterm_flushes_the_store_and_a_restarted_server_gets_a_storage_hit(
    checkpoint: Path, tmp_path: Path, served
) -> None:
    store = tmp_path / "store"
    first = served.start(checkpoint, "--storage", f"file://{store}", "--page-size", "1")
    answer = first.chat().choices[0].message.content
    code, out, err = first.stop(signal.SIGTERM)
    assert code == 0 and "Traceback" not in err, err
    assert "float32 on cpu" in out and "device pool 512 tokens" in out  # the startup summary
    written = int(out.split("stopped; ")[1].split(" pages")[0])
    files = [f for f in store.rglob("*") if f.is_file()]
    assert written > 5 and len(files) == written  # page size 1: a file per token, none left half-written
    assert not [f for f in files if "~" in f.name]

    second = served.start(
        checkpoint, "--storage", f"file://{store}", "--page-size", "1", "--max-body-mb", "1"
    )
    assert second.chat().choices[0].message.content == answer
    big = httpx.post(second.base + "/v1/chat/completions", content=b" " * (1 << 20 | 1))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    got = second.metrics()
    assert got['kvtier_cache_prompt_tokens_total{tier="storage"}'] > 5
    assert got["kvtier_storage_pages_read_total"] == got['kvtier_cache_prompt_tokens_total{tier="storage"}']
    assert got["kvtier_storage_bytes_read_total"] > 0
    assert got["kvtier_storage_prefetch_seconds_count"] == 1
    assert got["kvtier_storage_stored_pages"] >= written and got["kvtier_storage_stored_bytes"] > 0
    for op in ("exists", "get", "put"):
        assert got[f'kvtier_storage_errors_total{{op="{op}"}}'] == 0
    assert not [v for n, v in got.items() if n.startswith("kvtier_storage_rejected_total") and v]
    code, _, err = second.stop(signal.SIGINT)  # Ctrl-C
    assert code == 0 and "Traceback" not in err, err
