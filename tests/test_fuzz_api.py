"""Fuzzing the OpenAI API: schemathesis requests against `kvtier serve` on the tiny model.

The schema is the one the app publishes at `/openapi.json`. Where a POST route there
declares no request body (the routes read the body themselves), the body schema of this
file is added: OpenAI's chat and completions fields, with `max_tokens` capped at 8 so a
request stays short. Every operation is fuzzed with valid bodies and, through
schemathesis' negative mode, invalid ones (wrong types, values out of range, fields
missing or unknown). Every response must be:

- never a 5xx;
- a 4xx: OpenAI's error object, `{"error": {"message", "type", "param", "code"}}` and
  nothing else (message and type strings, param and code strings or null);
- a 200 to a POST: a completion object with choices, or an event stream of JSON events
  (an error event in the same shape) ending in `data: [DONE]`.

Methods a route does not declare, and an unknown route, are probed as well. Each run is
bounded (`MAX_EXAMPLES` per operation and mode, a per-request timeout, a deadline per
example) and derandomized, so CI sees the same requests each time. Every failure found is
collected, not just the first: the test fails listing each kind once, with the curl
command of the first request that showed it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import pytest

# schemathesis is a dev dependency (imported below, never skipped); the server needs the engine's.
for needed in ("transformers", "fastapi", "uvicorn", "httpx", "tokenizers"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from served import MODEL, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402

# Generated requests per operation and generation mode: about 400 requests in all (the GET
# routes take no input, so each has one request).
MAX_EXAMPLES = 100
REQUEST_TIMEOUT_S = 30
# Per example (one request): far above what the tiny model needs, below a hang.
DEADLINE = timedelta(seconds=20)
MAX_TOKENS = 8
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TOKEN_IDS = {"type": "integer", "minimum": 0, "maximum": 299}  # the tiny tokenizer's vocabulary

_text = {"type": "string", "maxLength": 40}
_stop = {"anyOf": [_text, {"type": "array", "items": _text, "maxItems": 4}, {"type": "null"}]}
_part = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": _text},
    "required": ["type", "text"],
    "additionalProperties": False,
}
_message = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": {"anyOf": [_text, {"type": "array", "items": _part, "maxItems": 2}, {"type": "null"}]},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
# What both routes share: sampling, streaming, penalties; each bounded so a request is short.
_common = {
    "model": {"const": MODEL},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
    "stop": _stop,
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},  # OpenAI's range
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
        "additionalProperties": False,
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "user": {"type": "string", "maxLength": 16},
}
CHAT_BODY = {
    "type": "object",
    "properties": {
        **_common,
        "messages": {"type": "array", "items": _message, "minItems": 1, "maxItems": 3},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
    },
    "required": ["model", "messages", "max_tokens"],
    "additionalProperties": False,
}
COMPLETIONS_BODY = {
    "type": "object",
    "properties": {
        **_common,
        "prompt": {
            "anyOf": [
                _text,
                {"type": "array", "items": _text, "minItems": 1, "maxItems": 2},
                {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 16},
                {
                    "type": "array",
                    "items": {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 8},
                    "minItems": 1,
                    "maxItems": 2,
                },
            ]
        },
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
        "echo": {"type": "boolean"},
    },
    "required": ["model", "prompt", "max_tokens"],
    "additionalProperties": False,
}
BODIES = {CHAT: CHAT_BODY, TEXT: COMPLETIONS_BODY}
METHODS = ("get", "post", "put", "patch", "delete")


def raw_body(route: str, **fields: str) -> tuple[str, str]:
    """`(route, body)`: the tiny model, a short chat or prompt and `max_tokens` 2, with `fields`
    (each value raw JSON text, valid or not) over them."""
    body = {"model": json.dumps(MODEL), "max_tokens": "2"}
    body |= {"messages": '[{"role": "user", "content": "hi"}]'} if route == CHAT else {"prompt": '"a"'}
    body |= fields
    return route, "{" + ", ".join(f'"{k}": {v}' for k, v in body.items()) + "}"


# Bodies that no JSON schema describes, or that generation rarely reaches: Python's json
# module reads NaN, Infinity, numbers past a float's range and lone surrogates; int64's edges
# and values just inside the ranges (a temperature or top_p of 1e-300 is valid); nesting past
# the recursion limit; an integer too long to convert. Each must be answered like any other.
RAW_BODIES = {
    "max_tokens NaN": raw_body(CHAT, max_tokens="NaN"),
    "max_tokens Infinity": raw_body(TEXT, max_tokens="Infinity"),
    "max_tokens 1e400": raw_body(TEXT, max_tokens="1e400"),
    "max_tokens of 5000 digits": raw_body(TEXT, max_tokens="9" * 5000),
    "top_p -Infinity": raw_body(TEXT, top_p="-Infinity"),
    "temperature 1e-300": raw_body(TEXT, temperature="1e-300"),
    "top_p 1e-300": raw_body(TEXT, temperature="1", top_p="1e-300"),
    "seed NaN": raw_body(TEXT, temperature="1", seed="NaN"),
    "seed 2**64": raw_body(TEXT, temperature="1", seed=str(2**64)),
    "seed -(2**63) - 1": raw_body(TEXT, temperature="1", seed=str(-(2**63) - 1)),
    "seed 1e30": raw_body(TEXT, temperature="1", seed="1e30"),
    "a lone surrogate in content": raw_body(CHAT, messages='[{"role": "user", "content": "\\ud800"}]'),
    "a lone surrogate in prompt": raw_body(TEXT, prompt='"a\\udfff"'),
    "a lone surrogate in stop": raw_body(TEXT, stop='"\\ud800"'),
    "nesting 100000 deep": raw_body(TEXT, prompt="[" * 100000 + "]" * 100000),
    "a JSON array": (CHAT, "[]"),
    "JSON null": (TEXT, "null"),
}


@pytest.fixture(scope="module")
def base():
    tokenizer = tiny_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=512, host_tokens=2048)
    with serving(create_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def published(base) -> dict:
    """The app's own OpenAPI document."""
    response = httpx.get(base + "/openapi.json", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def with_bodies(doc: dict) -> dict:
    """`doc` with this file's body schema on each POST route of `BODIES` that declares none."""
    doc = json.loads(json.dumps(doc))
    for path, body in BODIES.items():
        post = doc["paths"][path]["post"]
        post.setdefault("requestBody", {"required": True, "content": {"application/json": {"schema": body}}})
    return doc


@dataclass(frozen=True)
class Failure:
    """One kind of wrong answer, and the first request that got it."""

    kind: str
    detail: str
    request: str


def error_shape_problem(payload: object) -> str | None:
    """What makes `payload` other than OpenAI's error object; None when it is one."""
    if not isinstance(payload, dict) or set(payload) != {"error"}:
        return f"not {{'error': ...}} alone: {json.dumps(payload)[:200]}"
    error = payload["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"error object keys are not message, type, param, code: {json.dumps(error)[:200]}"
    if not (isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)):
        return f"message or type not a non-empty string: {json.dumps(error)[:200]}"
    if not all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")):
        return f"param or code neither a string nor null: {json.dumps(error)[:200]}"
    return None


def requested_choices(body: object) -> int | None:
    """The choices a request body asks for: `n` (1 when it names none) per prompt, a completions
    `prompt` list being several prompts (OpenAI's rule); None where `n` is not a positive int."""
    n = body.get("n", 1) if isinstance(body, dict) else None
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        return None
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt)
    return n * len(prompt) if several else n


def stream_problem(text: str, n: int | None) -> str | None:
    """What is wrong with a 200 event stream; None when every event is JSON, its choices are
    indexed 0 to n - 1 and it ends in [DONE]."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end in data: [DONE]: {text[-200:]!r}"
    indices, failed = set(), False
    for event in events[:-1]:
        try:
            payload = json.loads(event)
        except json.JSONDecodeError:
            return f"an event is not JSON: {event[:200]!r}"
        if "error" in payload:
            failed = True
            if (trouble := error_shape_problem(payload)) is not None:
                return f"an error event: {trouble}"
        elif not isinstance(payload.get("choices"), list):
            return f"an event without choices: {event[:200]!r}"
        else:
            indices |= {c.get("index") for c in payload["choices"]}
    if n is not None and not failed and indices != set(range(n)):
        return f"n={n}, but the stream's choices have indices {sorted(indices, key=str)}"
    return None


def problem(
    method: str, status: int, content_type: str, text: str, n: int | None = None
) -> tuple[str, str] | None:
    """`(kind, detail)` of what is wrong with one response (`n`: the choices asked for, where known);
    None when it is right."""
    if status >= 500:
        return f"{status}", text[:300]
    if 400 <= status < 500:
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return f"{status} not JSON", text[:300]
        shape = error_shape_problem(payload)
        return None if shape is None else (f"{status} not OpenAI's error shape", shape)
    if status == 200 and method == "POST":
        if content_type.startswith("text/event-stream"):
            trouble = stream_problem(text, n)
            return None if trouble is None else ("200 stream malformed", trouble)
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            return "200 not JSON", text[:300]
        if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
            return "200 without choices", text[:300]
        if n is not None and len(payload["choices"]) != n:
            return "200 with another number of choices than n", f"n={n}, {len(payload['choices'])} choices"
    return None


class Findings:
    """Every answer's status by route, and the failures by kind: the first request of each kind kept.

    A kind is the route, what was wrong and the answer with its numbers and quoted values
    blanked, so one bug met with many values is listed once.
    """

    def __init__(self) -> None:
        self.by_kind: dict[tuple[str, str, str], Failure] = {}
        self.statuses: Counter[tuple[str, int]] = Counter()

    def add(self, route: str, status: int, wrong: tuple[str, str] | None, request: str) -> None:
        self.statuses[route, status] += 1
        if wrong is not None:
            kind, detail = wrong
            shape = re.sub(r"\d+(\.\d+)?(e-?\d+)?|'[^']*'", "_", detail)[:120]
            self.by_kind.setdefault((route, kind, shape), Failure(f"{route}: {kind}", detail, request))

    def report(self) -> str:
        seen = ", ".join(f"{route} {status} x{n}" for (route, status), n in sorted(self.statuses.items()))
        lines = [f"{len(self.by_kind)} kinds of failure in {self.statuses.total()} requests ({seen}):"]
        for f in self.by_kind.values():
            lines += [f"- {f.kind}: {f.detail}", f"  {f.request}"]
        return "\n".join(lines)


def operations(doc: dict) -> list[tuple[str, str]]:
    return [
        (path, method.upper()) for path, item in doc["paths"].items() for method in item if method in METHODS
    ]


def _modes(operation) -> list[GenerationMode]:
    """Negative requests only where the operation has something to get wrong (a body or parameters)."""
    has_inputs = bool(operation.body) or any(True for _ in operation.iter_parameters())
    return [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_inputs else [GenerationMode.POSITIVE]


def fuzz(base: str, operation, mode: GenerationMode, findings: Findings) -> None:
    """`MAX_EXAMPLES` requests of `mode` for `operation`, every answer added to `findings`."""
    route = f"{operation.method.upper()} {operation.path}"

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=DEADLINE,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        curl = case.as_curl_command(base_url=base)
        try:
            response = case.call(base_url=base, timeout=REQUEST_TIMEOUT_S)
        except Exception as e:  # a hang or a dropped connection is a finding too
            findings.add(route, 0, (f"no response ({type(e).__name__})", str(e)[:300]), curl)
            return
        content_type = response.headers.get("content-type", [""])[0]
        n = requested_choices(case.body)
        wrong = problem(
            operation.method.upper(),
            response.status_code,
            content_type,
            response.content.decode("utf-8", "replace"),
            n,
        )
        findings.add(route, response.status_code, wrong, curl)

    one()


def test_the_published_schema_has_the_routes(published) -> None:
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(published["paths"])


def test_fuzz_every_operation(base, published) -> None:
    """Schemathesis' requests for every operation of the published schema (bodies added where none)."""
    schema = schemathesis.openapi.from_dict(with_bodies(published))
    schema.config.output.sanitization.update(enabled=False)  # it blanks max_tokens ("token") in curl
    findings = Findings()
    for path, method in operations(published):
        operation = schema[path][method]
        for mode in _modes(operation):
            try:
                fuzz(base, operation, mode, findings)
            except Unsatisfiable:  # every value is valid (a free-text path parameter): no negative case
                if mode is not GenerationMode.NEGATIVE:
                    raise
    print(findings.report())
    # Valid bodies reached the engine (the fuzzing went past the parsing), and it still serves.
    for route in (f"POST {CHAT}", f"POST {TEXT}"):
        assert findings.statuses[route, 200], findings.report()
    assert httpx.get(base + "/health", timeout=10).status_code == 200, findings.report()
    assert not findings.by_kind, findings.report()


def test_bodies_no_schema_describes(base) -> None:
    """`RAW_BODIES`, sent as they are: no 5xx, every 4xx in OpenAI's shape, the server still up."""
    findings = Findings()
    for name, (path, raw) in RAW_BODIES.items():
        curl = f"curl -X POST {base}{path} -H 'content-type: application/json' -d '{raw[:200]}'"
        try:
            response = httpx.post(
                base + path,
                content=raw,
                headers={"content-type": "application/json"},
                timeout=REQUEST_TIMEOUT_S,
            )
        except httpx.HTTPError as e:
            findings.add(name, 0, (f"no response ({type(e).__name__})", str(e)[:300]), curl)
            continue
        content_type = response.headers.get("content-type", "")
        findings.add(
            name,
            response.status_code,
            problem("POST", response.status_code, content_type, response.text),
            curl,
        )
    assert httpx.get(base + "/health", timeout=10).status_code == 200, findings.report()
    assert not findings.by_kind, findings.report()


def test_undeclared_methods_and_routes_answer_in_openai_shape(base, published) -> None:
    """Every method a route does not declare (405), and an unknown route (404): OpenAI's error object."""
    findings = Findings()
    probes = [
        (m.upper(), path) for path, item in published["paths"].items() for m in METHODS if m not in item
    ]
    probes.append(("GET", "/v1/no-such-route"))
    for method, path in probes:
        response = httpx.request(method, base + path, timeout=REQUEST_TIMEOUT_S)
        status = response.status_code
        wrong = problem(method, status, response.headers.get("content-type", ""), response.text)
        if status not in (404, 405):
            wrong = wrong or (f"{status}, not 404 or 405", response.text[:300])
        what = "an unknown route" if path not in published["paths"] else "a method the route lacks"
        findings.add(what, status, wrong, f"curl -X {method} {base}{path}")
    assert not findings.by_kind, findings.report()
