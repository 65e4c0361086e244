"""The server as OpenAI clients expect it: messages with content parts, chat templates, errors
in OpenAI's shape for every route, method and crash, `/v1/models/{id}`, `/version`, the API key.

The official `openai` client and httpx against apps in this process over the tiny random
model; `kvtier serve` as a process of its own for its startup warning, `--chat-template`
and the key from the environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import openai  # noqa: E402
from redis_servers import free_port  # noqa: E402
from served import MESSAGES, MODEL, TEMPLATE, serving, tiny_model, tiny_tokenizer  # noqa: E402

import kvtier  # noqa: E402
from kvtier.engine import Engine  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-0123456789"
ERROR_FIELDS = {"message", "type", "param", "code"}


def engine_of(tokenizer) -> Engine:
    return Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=1024)


def no_template_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


@pytest.fixture(scope="module")
def server():
    """The app over the tiny model, with two routes of its own for the validation and crash handlers."""
    app = create_app(engine_of(tiny_tokenizer()), MODEL)

    @app.get("/test/typed")
    async def typed(n: int) -> dict:
        return {"n": n}

    @app.get("/test/crash")
    async def crash() -> dict:
        raise RuntimeError("boom")

    with serving(app) as base:
        yield base


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def reply(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, **kw)


def chat(client: openai.OpenAI, messages: list[dict], **kw) -> str:
    return reply(client, messages, **kw).choices[0].message.content


def refused(call, status: int) -> openai.APIStatusError:
    """The error the client raises for `call()`, which must be `status` in OpenAI's shape."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    error = caught.value
    assert error.status_code == status and set(error.body) == ERROR_FIELDS, error.body
    assert error.body["message"] and error.body["type"]
    return error


def shaped(r: httpx.Response, status: int) -> dict:
    """The error object of an answer that must be `status` in OpenAI's shape (never FastAPI's)."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    return body["error"]


# -- messages --------------------------------------------------------------------------------


def test_text_parts_are_joined_by_newlines(client) -> None:
    parts = [{"type": "text", "text": "the quick brown fox"}, {"type": "text", "text": "jumps over"}]
    as_parts = reply(client, [{"role": "user", "content": parts}])
    as_text = reply(client, [{"role": "user", "content": "the quick brown fox\njumps over"}])
    spaced = reply(client, [{"role": "user", "content": "the quick brown fox jumps over"}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    # The prompt is the newline-joined text (a space between the parts tokenises shorter).
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens != spaced.usage.prompt_tokens


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ([{"type": "image_url", "image_url": {"url": "http://x/a.png"}}], "type 'image_url'"),
        ([{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}], "content[1]"),
        ([{"type": "text", "text": 3}], "text must be a string"),
        (["hi"], "only text parts are supported"),
        (42, "a string or a list of text parts; got a number"),
    ],
)
def test_other_content_is_refused_naming_messages(client, content, says) -> None:
    messages = [{"role": "user", "content": content}]
    error = refused(lambda: chat(client, messages), 400)
    assert error.body["param"] == "messages" and says in error.body["message"]


def test_an_assistant_content_of_null_is_an_empty_turn(client) -> None:
    turns = [{"role": "user", "content": "the quick brown fox"}, None, {"role": "user", "content": "jumps"}]
    null = chat(client, [turns[0], {"role": "assistant", "content": None}, turns[2]])
    empty = chat(client, [turns[0], {"role": "assistant", "content": ""}, turns[2]])
    assert null == empty


def test_developer_is_a_system_message(client) -> None:
    question = {"role": "user", "content": "jumps over the lazy dog"}
    as_developer = chat(client, [{"role": "developer", "content": "the quick brown fox"}, question])
    assert as_developer == chat(client, [{"role": "system", "content": "the quick brown fox"}, question])


@pytest.mark.parametrize(
    ("messages", "extra", "param", "says"),
    [
        ([{"role": "wizard", "content": "hi"}], {}, "messages", "must be one of system, developer, user"),
        ([{"role": ["user"], "content": "hi"}], {}, "messages", "messages[0].role"),
        (
            [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}],
            {},
            "messages",
            "messages[1]",
        ),
        ([{"role": "user", "content": None}], {}, "messages", "got null"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}],
            {},
            "messages",
            "tool_calls",
        ),
        (
            MESSAGES,
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
            "not supported",
        ),
        (MESSAGES, {"tool_choice": "required"}, "tool_choice", "not supported"),
    ],
)
def test_roles_and_tools_that_are_not_supported_are_400(client, messages, extra, param, says) -> None:
    error = refused(lambda: chat(client, messages, extra_body=extra), 400)
    assert error.body["param"] == param and says in error.body["message"], error.body


def test_a_template_that_refuses_the_messages_is_a_400_not_a_500() -> None:
    tokenizer = tiny_tokenizer()
    refuse = "{{ raise_exception('no system messages, please') }}"
    tokenizer.chat_template = f"{{% if messages[0]['role'] == 'system' %}}{refuse}{{% endif %}}{TEMPLATE}"
    with serving(create_app(engine_of(tokenizer), MODEL)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        error = refused(lambda: chat(client, MESSAGES), 400)
        assert "no system messages, please" in error.body["message"] and error.body["param"] == "messages"
        assert chat(client, MESSAGES[1:]) is not None


# -- chat templates --------------------------------------------------------------------------


def test_without_a_chat_template_chats_are_400_and_completions_work(caplog) -> None:
    with caplog.at_level("WARNING", logger="kvtier.server.app"):
        app = create_app(engine_of(no_template_tokenizer()), MODEL)
    assert "has no chat template" in caplog.text and "--chat-template FILE" in caplog.text
    with serving(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        error = refused(lambda: chat(client, MESSAGES), 400)
        assert error.body["code"] == "chat_template_missing" and "--chat-template" in error.body["message"]
        done = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=3, temperature=0)
        assert done.choices[0].text is not None and done.usage.completion_tokens > 0


def test_a_chat_template_given_to_the_engine_serves_chats() -> None:
    engine = engine_of(no_template_tokenizer())
    with pytest.raises(ConfigError, match="no chat template"):
        engine.encode_chat(MESSAGES)
    with pytest.raises(ConfigError, match="not valid Jinja: line 1"):
        engine.chat_template = "{% for m in messages %}"
    assert engine.chat_template is None  # a refused template changes nothing
    engine.chat_template = TEMPLATE
    reference = tiny_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert engine.encode_chat(MESSAGES) == list(reference["input_ids"])
    engine.close()


# -- errors for routes, methods, validation, crashes -----------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "says"),
    [
        ("GET", "/v1/nothing", 404, "there is no route GET /v1/nothing"),
        ("POST", "/v2/chat/completions", 404, "there is no route POST /v2/chat/completions"),
        ("GET", "/v1/chat/completions", 405, "/v1/chat/completions does not take GET; it takes POST"),
        ("DELETE", "/v1/models", 405, "does not take DELETE"),
        ("POST", "/health", 405, "it takes GET"),
    ],
)
def test_unknown_routes_and_methods_are_answered_in_openai_shape(server, method, path, status, says) -> None:
    r = httpx.request(method, server + path)
    error = shaped(r, status)
    assert says in error["message"] and error["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"]


def test_fastapi_validation_is_a_400_in_openai_shape_never_a_422(server) -> None:
    error = shaped(httpx.get(server + "/test/typed", params={"n": "many"}), 400)
    assert error["param"] == "n" and "n" in error["message"]
    assert httpx.get(server + "/test/typed", params={"n": "3"}).json() == {"n": 3}


def test_a_crash_in_a_route_is_a_500_in_openai_shape_and_the_server_keeps_serving(server, client) -> None:
    error = shaped(httpx.get(server + "/test/crash"), 500)
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert chat(client, MESSAGES) is not None


def test_a_non_integer_is_refused_in_plain_english(client) -> None:
    error = refused(lambda: chat(client, MESSAGES, extra_body={"max_tokens": 1.5}), 400)
    assert error.body["message"] == "max_tokens must be an integer, got 1.5"


# -- models, version -------------------------------------------------------------------------


def test_a_model_card_by_id_or_model_not_found(client) -> None:
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "kvtier")
    error = refused(lambda: client.models.retrieve("gpt-unknown"), 404)
    assert error.body["code"] == "model_not_found" and "gpt-unknown" in error.body["message"]
    nested = httpx.get(f"{client.base_url}models/org/gpt-unknown")  # ids with a slash reach the route
    assert shaped(nested, 404)["code"] == "model_not_found"


def test_version_is_the_packages_and_the_projects(server) -> None:
    declared = re.search(r'(?m)^version = "(.+)"$', (ROOT / "pyproject.toml").read_text()).group(1)
    assert httpx.get(server + "/version").json() == {"version": kvtier.__version__}
    assert kvtier.__version__ == declared


# -- the API key ------------------------------------------------------------------------------


def test_with_an_api_key_every_route_but_health_and_metrics_needs_it() -> None:
    app = create_app(engine_of(tiny_tokenizer()), MODEL, api_key=KEY)
    with serving(app) as base:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)

        assert chat(client(KEY), MESSAGES) is not None
        assert [m.id for m in client(KEY).models.list()] == [MODEL]
        for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
            error = refused(lambda w=wrong: chat(client(w), MESSAGES), 401)
            assert error.body["code"] == "invalid_api_key"
        refused(lambda: client("sk-wrong").models.list(), 401)
        for path in ("/version", "/v1/models", "/v1/nothing"):
            r = httpx.get(base + path)
            assert shaped(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        authorized = {"Authorization": f"bearer {KEY}"}  # the scheme's case does not matter
        assert httpx.get(base + "/version", headers=authorized).status_code == 200
        assert httpx.get(base + "/health").status_code == 200
        metrics = httpx.get(base + "/metrics")
        assert metrics.status_code == 200 and 'kvtier_requests_total{status="401"}' in metrics.text


def test_an_empty_api_key_is_refused() -> None:
    engine = engine_of(tiny_tokenizer())
    with pytest.raises(ConfigError, match="api_key is empty"):
        create_app(engine, MODEL, api_key=" ")
    engine.close()


# -- `kvtier serve` as a process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def templateless_checkpoint(tmp_path_factory) -> Path:
    """The tiny model and its tokenizer saved without a chat template."""
    path = tmp_path_factory.mktemp("no-template")
    tokenizer = no_template_tokenizer()
    tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert "chat_template" not in (path / "tokenizer_config.json").read_text()
    return path


def serve(checkpoint: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`kvtier serve` on a free port, ready to answer: the process and its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "kvtier", "serve", "--model", str(checkpoint), "--device", "cpu"]
    argv += ["--device-tokens", "512", "--host-tokens", "1024", "--model-name", MODEL, "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    base, deadline = f"http://127.0.0.1:{port}", time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"kvtier serve did not start (exit {proc.returncode}):\n{out}\n{err}")


def stopped(proc: subprocess.Popen) -> tuple[str, str]:
    proc.terminate()
    try:
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_warns_of_a_missing_template_and_reads_its_key_from_the_environment(
    templateless_checkpoint: Path,
) -> None:
    proc, base = serve(templateless_checkpoint, env={**os.environ, "KVTIER_API_KEY": KEY})
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
        refused(lambda: openai.OpenAI(base_url=base + "/v1", api_key="no", max_retries=0).models.list(), 401)
        assert refused(lambda: chat(client, MESSAGES), 400).body["code"] == "chat_template_missing"
        done = client.completions.create(model=MODEL, prompt="the quick", max_tokens=2, temperature=0)
        assert done.usage.completion_tokens > 0
    finally:
        out, err = stopped(proc)
    warnings = [line for line in err.splitlines() if "has no chat template" in line]
    assert len(warnings) == 1 and "--chat-template FILE" in warnings[0], err
    assert "API key required" in out


def test_serve_takes_a_chat_template_file_and_a_key_flag(
    templateless_checkpoint: Path, tmp_path: Path
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    proc, base = serve(templateless_checkpoint, "--chat-template", str(template), "--api-key", KEY)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert chat(client, MESSAGES) is not None
        assert refused(lambda: openai.OpenAI(base_url=base + "/v1", api_key="no").models.list(), 401)
    finally:
        _, err = stopped(proc)
    assert "has no chat template" not in err
