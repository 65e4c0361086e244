"""OpenAI's API shapes for `kvtier serve`: request bodies checked, response objects, errors.

Each check raises `APIError` (the status and OpenAI's `type`, `param`, `code`) before the
request reaches the engine: `parse_body` (a JSON object), `check_model`, `chat_messages` /
`text_prompt`, `sampling` (every range `SamplingParams` checks, with the API's `param`).
`Reply` builds the response objects and server-sent events of one request;
`failure_error` / `unfinished_error` say what a failed, timed-out or cancelled request is
answered with; `not_found`, `method_not_allowed`, `unauthorized` and `no_chat_template`
what a request no route serves, a missing key and a model without a chat template are.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.engine.results import RequestResult
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import APIError, ConfigError, PromptTooLongError


@dataclass(frozen=True)
class Reply:
    """What every response object of one request repeats: its id, creation time, kind and model."""

    rid: str
    created: int
    chat: bool
    model: str

    def whole(self, result: RequestResult) -> dict:
        """The non-streamed response object."""
        finish = result.finish_reason
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": finish, "logprobs": None}
        n, k = result.prompt_tokens, len(result.tokens)
        usage = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
        return {**self._object("chat.completion", [choice]), "usage": usage}

    def chunk(self, choice: dict) -> str:
        """One server-sent event of a streamed response."""
        payload = self._object("chat.completion.chunk", [{"index": 0, "finish_reason": None, **choice}])
        return f"data: {json.dumps(payload)}\n\n"

    def _object(self, chat_kind: str, choices: list[dict]) -> dict:
        kind = chat_kind if self.chat else "text_completion"
        return {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def failure_error(error: BaseException) -> APIError:
    """The API's answer to a request that failed in the worker."""
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, ConfigError):
        return APIError(400, str(error))
    return APIError(500, f"generation failed: {error}", type_="server_error")


def unfinished_error(result: RequestResult, params: SamplingParams) -> APIError | None:
    """The error a request that ended without finishing is answered with; None where it finished."""
    if result.finish_reason == "timeout":
        return APIError(
            504,
            f"the request timed out after {params.timeout_s:g} s ({len(result.tokens)} tokens generated)",
            type_="timeout_error",
            code="request_timeout",
        )
    if result.finish_reason == "cancelled":
        return APIError(499, "request cancelled", type_="cancelled")
    return None


def too_large(limit: int) -> APIError:
    """The answer to a body over `limit` bytes."""
    return APIError(
        413, f"the request body exceeds the server's limit of {limit} bytes", code="request_too_large"
    )


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; 400 for anything else (runs off the event loop)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(400, "you must provide a model parameter", param="model")
    if model != model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server has {model_name!r}",
            param="model",
            code="model_not_found",
        )


# The roles a chat's messages may have, and the role the template sees for each.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields of a chat request for tools and function calling, which kvtier does not support.
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The chat's messages as `{role, content}` with text content; 400 naming `messages` otherwise.

    Content is a string or a list of text parts (joined by newlines); an assistant's may be
    null (empty). `developer` is a system message. Tools are not supported: a `tool`
    message, an assistant's `tool_calls` and a request's `tools` are refused.
    """
    for name in TOOL_FIELDS:
        if body.get(name) not in (None, [], "none"):
            raise APIError(400, f"{name}: tools and function calling are not supported", param=name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, str]:
    """Message `i` of a chat as `{role, content}`, its content joined into one text."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"{where} must be an object with a role and a content", param="messages")
    role = m.get("role")
    if role in ("tool", "function"):
        raise APIError(400, f"{where} has role {role!r}: tools are not supported", param="messages")
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param="messages")
    if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
        raise APIError(400, f"{where} has tool_calls: tools are not supported", param="messages")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise APIError(
            400,
            f"{where}.content must be a string or a list of text parts; got {_kind(content)}",
            param="messages",
        )
    return {"role": ROLES[role], "content": content}


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = repr(part.get("type")) if isinstance(part, dict) else _kind(part)
        raise APIError(400, f"{where} has type {kind}: only text parts are supported", param="messages")
    if not isinstance(part.get("text"), str):
        raise APIError(400, f"{where}.text must be a string", param="messages")
    return part["text"]


def _kind(value: Any) -> str:
    """The JSON name of `value`'s type, for messages: null, a number, an object, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), type(value).__name__)


def text_prompt(body: dict) -> str:
    text = body.get("prompt")
    if not isinstance(text, str) or not text:
        raise APIError(400, "prompt must be a non-empty string", param="prompt")
    return text


def no_chat_template(model_name: str) -> APIError:
    """The answer to a chat request where the model's tokenizer has no chat template."""
    return APIError(
        400,
        f"the model {model_name!r} has no chat template, so chat completions are not available: "
        "start the server with --chat-template FILE, or send text to /v1/completions",
        param="messages",
        code="chat_template_missing",
    )


def not_found(method: str, path: str) -> APIError:
    return APIError(404, f"there is no route {method} {path} on this server", code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: str) -> APIError:
    return APIError(405, f"{path} does not take {method}; it takes {allowed}", code="method_not_allowed")


def unauthorized() -> APIError:
    return APIError(
        401,
        "the API key is missing or wrong: send the server's key as the header Authorization: Bearer KEY",
        code="invalid_api_key",
    )


def sampling(body: dict, timeout_s: float) -> SamplingParams:
    """The body's sampling fields, each range checked with its `param`; `timeout_s` is the server's."""

    def number(name: str, default, kind=float):
        v = body.get(name, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and v != int(v)):
            raise APIError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", param=name)
        return kind(v)

    max_tokens = number("max_completion_tokens", None, int)
    if max_tokens is None:
        max_tokens = number("max_tokens", 64, int)
    temperature = number("temperature", 1.0)
    top_p = number("top_p", 1.0)
    seed = number("seed", None, int)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    # Every range SamplingParams checks was checked above, with the API's `param`.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        stop=tuple(stop),
        seed=seed,
        timeout_s=timeout_s,
    )


class TextStream:
    """The text deltas of a growing answer, decoding a few tokens per token (not the whole answer).

    Each delta is the text a new token adds after the tokens before it, decoded over a
    short window (so a tokenizer that drops a leading space at the start of a decode still
    gives the space); a token that ends inside a multi-byte character waits for the next.
    `rest(text)`: what of the whole answer's text was not sent yet.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix = self.read = 0
        self.sent = ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix : self.read])
        text = self.decode(self.tokens[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        delta = text[len(before) :]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        return text[len(self.sent) :] if text.startswith(self.sent) else ""
