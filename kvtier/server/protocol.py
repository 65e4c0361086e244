"""OpenAI's API shapes for `kvtier serve`: request bodies checked, response objects, errors.

Each check raises `APIError` (the status and OpenAI's `type`, `param`, `code`) before the
request reaches the engine: `parse_body` (a JSON object), `check_model`, `chat_messages` /
`text_prompt` (the other fields: `kvtier.server.params`).
`Reply` builds the response objects and server-sent events of one request (its choices,
their logprobs, its usage); `ChoiceStream` the text deltas of one streamed choice, stop
strings held back; `failure_error` / `unfinished_error` say what a failed, timed-out or
cancelled request is answered with; `not_found`, `method_not_allowed`, `unauthorized` and
`no_chat_template` what a request no route serves, a missing key and a model without a
chat template are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.engine.results import RequestResult
from kvtier.engine.sampling import SamplingParams, TokenLogprob, held_back, stop_index
from kvtier.errors import APIError, ConfigError, PromptTooLongError


@dataclass(frozen=True)
class Reply:
    """What every response object of one request repeats: its id, creation time, kind and model.

    `token_text`: one token's text (for logprobs); `include_usage`: streamed chunks carry a
    `usage` field (null but in the last, whose `choices` are empty).
    """

    rid: str
    created: int
    chat: bool
    model: str
    token_text: Callable[[int], str]
    include_usage: bool = False

    def whole(self, results: list[RequestResult], prompt_tokens: int, echoes: Sequence[str] = ()) -> dict:
        """The non-streamed response object: choice `i` is `results[i]`, after `echoes[i]` if given."""
        choices = [self._choice(i, r, echoes[i] if echoes else "") for i, r in enumerate(results)]
        return {**self._object("chat.completion", choices), "usage": usage(prompt_tokens, results)}

    def chunk(self, index: int, choice: dict) -> str:
        """One server-sent event of a streamed response, for choice `index`."""
        chunk = {"index": index, "finish_reason": None, "logprobs": None, **choice}
        return self._event(self._object("chat.completion.chunk", [chunk]))

    def delta(self, index: int, text: str) -> str:
        """The event adding `text` to choice `index`."""
        return self.chunk(index, {"delta": {"content": text}} if self.chat else {"text": text})

    def finish(self, index: int, reason: str) -> str:
        """The event ending choice `index`."""
        end = {"delta": {}} if self.chat else {"text": ""}
        return self.chunk(index, {**end, "finish_reason": reason})

    def usage_chunk(self, prompt_tokens: int, results: Sequence[RequestResult]) -> str:
        """The last event of a stream with `include_usage`: no choices, the whole request's usage."""
        payload = self._object("chat.completion.chunk", [])
        return self._event({**payload, "usage": usage(prompt_tokens, results)})

    def _choice(self, index: int, result: RequestResult, echo: str) -> dict:
        lps = result.logprobs
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            logprobs = chat_logprobs(lps, self.token_text) if lps is not None else None
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
            }
        logprobs = completion_logprobs(lps, self.token_text) if lps is not None else None
        return {
            "index": index,
            "text": echo + result.text,
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
        }

    def _event(self, payload: dict) -> str:
        if self.include_usage:
            payload.setdefault("usage", None)
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


def usage(prompt_tokens: int, results: Sequence[RequestResult]) -> dict:
    """OpenAI's `usage`: every prompt counted once, every choice's tokens."""
    k = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": k, "total_tokens": prompt_tokens + k}


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """A chat choice's `logprobs`: `content[j]` is token `j`'s text, logprob, bytes and top alternatives."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}

    content = [{**entry(x.token, x.logprob), "top_logprobs": [entry(*t) for t in x.top]} for x in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """A text choice's `logprobs`: tokens, their logprobs, the top ones (the chosen among them) and
    where each token's text starts in the choice's text."""
    tokens = [token_text(x.token) for x in logprobs]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [
        {**{token_text(t): _floor(v) for t, v in x.top}, text: _floor(x.logprob)}
        for x, text in zip(logprobs, tokens, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [_floor(x.logprob) for x in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _floor(logprob: float) -> float:
    """A logprob JSON can carry: OpenAI's -9999 for a token the model rules out (-inf)."""
    return max(logprob, -9999.0)


def failure_error(error: BaseException) -> APIError:
    """The API's answer to a request that failed in the worker."""
    if isinstance(error, APIError):  # the worker's own answer (`kvtier.server.worker.SHUTDOWN`)
        return error
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
        body = json.loads(raw, parse_constant=_no_constant, parse_int=_int)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:  # a "\ud800" escape parses to a lone surrogate, which no tokenizer takes
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "the request body has an unpaired UTF-16 surrogate escape") from None
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 30:  # far past any count or seed; bounds int() on hostile input
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


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


class TextStream:
    """The text deltas of a growing answer, decoding a few tokens per token (not the whole answer).

    Each delta is the text a new token adds after the tokens before it, decoded over a
    short window (so a tokenizer that drops a leading space at the start of a decode still
    gives the space); a token that ends inside a multi-byte character waits for the next.
    `sent`: the text sent so far.
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


class ChoiceStream:
    """The text deltas of one streamed choice: `TextStream`'s, less any text of a stop string.

    Text that could still be the start of a stop string is held back until the next token
    says otherwise; text from a stop string on is never sent. `rest(text)`: what of the
    choice's final text (already cut before its stop string) was not sent yet.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self.text = TextStream(decode)
        self.stop = stop
        self.pending = self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.pending += self.text.push(token)
        cut = stop_index(self.pending, self.stop)
        if cut is not None:
            self.stopped = True
        else:
            cut = len(self.pending) - held_back(self.pending, self.stop)
        delta, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += delta
        return delta

    def rest(self, text: str) -> str:
        return text[len(self.sent) :] if text.startswith(self.sent) else ""
