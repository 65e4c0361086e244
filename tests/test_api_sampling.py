"""Sampling, stop strings and OpenAI's request parameters, through the server and the `openai` client.

The app runs in this process over the tiny random model; references are plain forwards of
a second copy of the same model (the whole sequence each step, no cache).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

for needed in ("transformers", "fastapi", "uvicorn", "openai", "httpx", "tokenizers", "prometheus_client"):
    pytest.importorskip(needed)

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from served import MESSAGES, MODEL, samples, serving, tiny_model, tiny_tokenizer  # noqa: E402

from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.server.app import create_app  # noqa: E402
from kvtier.server.protocol import ChoiceStream  # noqa: E402

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server():
    tokenizer = tiny_tokenizer()
    engine = Engine(tiny_model(tokenizer), tokenizer, device_tokens=2048, host_tokens=2048, max_num_seqs=16)
    with serving(create_app(engine, MODEL)) as base:
        yield base, engine, tokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_model(server):
    return tiny_model(server[2])


def reference(model, prompt: list[int], n: int, presence: float = 0.0, frequency: float = 0.0, k: int = 3):
    """Greedy tokens over plain forwards (penalties by OpenAI's formula), each with its raw logprob and
    the top `k` (ids, logprobs)."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        counts = torch.zeros_like(logits)
        for t in ids[len(prompt) :]:
            counts[t] += 1
        token = int(torch.argmax(logits - presence * (counts > 0).float() - frequency * counts))
        top = torch.topk(logp, k)
        out.append((token, float(logp[token]), top.indices.tolist(), top.values.tolist()))
        ids.append(token)
    return out


def streamed(chunks) -> dict[int, tuple[str, str | None]]:
    """Each choice's joined text and finish reason from a stream of chat or text chunks."""
    got: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk.choices:
            text = c.delta.content if hasattr(c, "delta") else c.text
            entry = got.setdefault(c.index, ["", None])
            entry[0] += text or ""
            entry[1] = c.finish_reason or entry[1]
    return {i: (t, f) for i, (t, f) in got.items()}


def device_hits_and_misses(base: str) -> tuple[float, float]:
    s = samples(httpx.get(base + "/metrics").text)
    name = "kvtier_cache_prompt_tokens_total"
    return s[name + '{tier="device"}'], s[name + '{tier="none"}']


# -- 1. sampling --------------------------------------------------------------------------


def test_unseeded_requests_draw_afresh_and_seeded_ones_repeat(client) -> None:
    def ask(**kw) -> str:
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, **kw
        )
        return out.choices[0].message.content

    assert len({ask() for _ in range(3)}) == 3
    seeded = [ask(seed=11) for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert ask(seed=12) != seeded[0]


def test_a_seeded_request_gives_its_text_whatever_runs_in_the_same_steps(server) -> None:
    base = server[0]

    async def run(others: int) -> str:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}
        try:
            outs = await asyncio.gather(
                client.chat.completions.create(**kw, seed=5),
                *(client.chat.completions.create(**kw, top_p=0.9) for _ in range(others)),
            )
        finally:
            await client.close()
        return outs[0].choices[0].message.content

    alone = asyncio.run(run(0))
    assert asyncio.run(run(6)) == alone


# -- 2. stop strings ----------------------------------------------------------------------


def baseline(client, prompt: str = PROMPT, max_tokens: int = 24) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def test_a_stop_string_is_cut_from_the_text_and_the_stream(client) -> None:
    whole = baseline(client)
    assert len(whole) > 20, whole  # the tiny model talks long enough for the stop to be inside
    stop = whole[8:14]  # spans several tokens: the stream holds its start back
    cut = whole[: whole.find(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    assert streamed(chunks) == {0: (cut, "stop")}


def test_the_first_stop_string_in_the_text_wins_in_chat_too(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert len(text) > 12, text
    early, late = text[4:6], text[10:12]
    cut = text[: min(text.find(early), text.find(late))]
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stop": [late, early]}
    out = client.chat.completions.create(**kw)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (cut, "stop")
    assert streamed(client.chat.completions.create(**kw, stream=True)) == {0: (cut, "stop")}
    never = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop="@@"
    )
    assert never.choices[0].message.content == text


def test_a_stream_holds_back_only_what_could_start_a_stop_string() -> None:
    """Characters as tokens: what was sent is always a prefix of the cut text, and text that
    cannot begin a stop string (a "c": no stop holds one) is sent at once."""
    gen = random.Random(0)
    for _ in range(300):
        stop = [
            "".join(gen.choice("ab") for _ in range(gen.randrange(1, 4))) for _ in range(gen.randrange(1, 3))
        ]
        text = "".join(gen.choice("abc") for _ in range(gen.randrange(1, 20)))
        firsts = [i for i in (text.find(s) for s in stop) if i >= 0]
        cut = text[: min(firsts)] if firsts else text
        stream = ChoiceStream(lambda ids: "".join(map(chr, ids)), stop)
        sent = ""
        for j, ch in enumerate(text):
            sent += stream.push(ord(ch))
            assert cut.startswith(sent), (stop, text, sent)
            if ch == "c" and len(cut) > j:
                assert sent == text[: j + 1], (stop, text, sent)
        assert sent + stream.rest(cut) == cut


# -- 3. parameters ------------------------------------------------------------------------


def test_n_choices_share_the_prompts_kv_and_usage_counts_the_prompt_once(server, client) -> None:
    base, engine = server[0], server[1]
    kw = {"model": MODEL, "max_tokens": 6}
    messages = [{"role": "user", "content": "kvtier keeps prefixes in host memory, choices share them"}]
    prompt = len(engine.encode_chat(messages))
    hits, misses = device_hits_and_misses(base)
    out = client.chat.completions.create(**kw, messages=messages, n=4, temperature=0.7, seed=1)
    hits2, misses2 = device_hits_and_misses(base)
    # Four matches of the prompt (its last token is always computed): one computes what no earlier
    # request left in the cache, the three others match all of it.
    assert misses2 - misses + hits2 - hits == 4 * (prompt - 1)
    assert hits2 - hits >= 3 * (prompt - 1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in out.choices}) > 1  # seed + j: the choices differ
    assert out.usage.prompt_tokens == prompt
    again = client.chat.completions.create(**kw, messages=messages, n=4, temperature=0.7, seed=1)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    one = client.chat.completions.create(**kw, messages=messages, temperature=0)
    greedy = client.chat.completions.create(**kw, messages=messages, n=3, temperature=0)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 3
    assert greedy.usage.prompt_tokens == prompt == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_streamed_choices_come_with_their_index(client) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 3}
    whole = client.completions.create(**kw)
    got = streamed(client.completions.create(**kw, stream=True))
    assert got == {c.index: (c.text, c.finish_reason) for c in whole.choices}
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2}
    whole = client.chat.completions.create(**chat)
    got = streamed(client.chat.completions.create(**chat, stream=True))
    assert got == {c.index: (c.message.content, c.finish_reason) for c in whole.choices}


def test_chat_logprobs_are_the_raw_log_softmax_with_the_top_k(server, client, reference_model) -> None:
    engine, tokenizer = server[1], server[2]
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    ref = reference(reference_model, engine.encode_chat(MESSAGES), len(content))
    assert len(content) == out.usage.completion_tokens
    for got, (token, logprob, top_ids, top_values) in zip(content, ref, strict=True):
        assert got.token == tokenizer.decode([token]) and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [tokenizer.decode([t]) for t in top_ids]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(top_values, abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content


def test_logprobs_come_before_temperature_and_penalties(server, reference_model) -> None:
    """A sampled, penalised request's logprobs are those of the raw logits of its own context."""
    tokenizer = server[2]
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=2, frequency_penalty=1.0, logprobs=2)
    with Engine(tiny_model(tokenizer), tokenizer, device_tokens=256, host_tokens=256) as engine:
        result = engine.generate(prompt, params)
    assert [x.token for x in result.logprobs] == result.tokens
    for j, x in enumerate(result.logprobs):
        with torch.no_grad():
            logits = reference_model(torch.tensor([prompt + result.tokens[:j]])).logits[0, -1].float()
        logp = torch.log_softmax(logits, -1)
        assert x.logprob == pytest.approx(float(logp[x.token]), abs=1e-4)
        assert [t for t, _ in x.top] == torch.topk(logp, 2).indices.tolist()


def test_completion_logprobs_shape(server, client, reference_model) -> None:
    tokenizer = server[2]
    prompt = tokenizer.encode(PROMPT)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    ref = reference(reference_model, prompt, 6, k=2)
    assert lp.tokens == [tokenizer.decode([t]) for t, *_ in ref]
    assert lp.token_logprobs == pytest.approx([v for _, v, *_ in ref], abs=1e-4)
    for top, (token, logprob, top_ids, top_values) in zip(lp.top_logprobs, ref, strict=True):
        want = {tokenizer.decode([t]): v for t, v in zip(top_ids, top_values, strict=True)}
        want[tokenizer.decode([token])] = logprob  # the chosen token is always among them
        assert top == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (2.0, 0.0), (-1.5, 0.5)])
def test_penalties_follow_openais_definition(server, client, reference_model, presence, frequency) -> None:
    tokenizer = server[2]
    prompt = tokenizer.encode("kvtier keeps prefixes")
    ref = [t for t, *_ in reference(reference_model, prompt, 20, presence, frequency)]
    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=0,
    )
    assert out.choices[0].logprobs.tokens == [
        tokenizer.decode([t]) for t in ref[: out.usage.completion_tokens]
    ]
    plain = [t for t, *_ in reference(reference_model, prompt, 20)]
    assert ref != plain  # the penalty changed the greedy answer: the comparison above means something


def test_include_usage_ends_the_stream_with_the_usage(client) -> None:
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 7, "temperature": 0, "n": 2}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None and c.choices for c in body)
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_echo_puts_the_prompt_before_the_text(client) -> None:
    text = baseline(client, max_tokens=8)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert out.choices[0].text == PROMPT + text
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "stream": True}
    assert streamed(client.completions.create(**kw))[0][0] == PROMPT + text


def test_prompts_as_lists_of_strings_and_of_token_ids(server, client) -> None:
    tokenizer = server[2]
    other = "kvtier keeps prefixes in host memory"
    first, second = baseline(client, PROMPT, 6), baseline(client, other, 6)
    out = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in out.choices] == [(0, first), (1, first), (2, second), (3, second)]
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode(other))
    ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(PROMPT), max_tokens=6, temperature=0)
    assert ids.choices[0].text == first
    both = [tokenizer.encode(PROMPT), tokenizer.encode(other)]
    lists = client.completions.create(model=MODEL, prompt=both, max_tokens=6, temperature=0)
    assert [c.text for c in lists.choices] == [first, second]


HARMLESS = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "stream_options": {"include_usage": True},  # without stream: nothing to do
    "parallel_tool_calls": True,
}


@pytest.mark.parametrize(("name", "value"), list(HARMLESS.items()))
def test_harmless_parameters_are_accepted(server, name, value) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, name: value}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


CHAT_REFUSED = [
    ({"logit_bias": {"5": 10}}, "logit_bias", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
    ({"response_format": {"type": "json_object"}}, "response_format", None),
    ({"top_k": 5}, "top_k", "unrecognized"),
    ({"echo": True}, "echo", "unrecognized"),
    ({"n": 0}, "n", None),
    ({"n": 129}, "n", None),
    ({"presence_penalty": 2.5}, "presence_penalty", None),
    ({"frequency_penalty": -3}, "frequency_penalty", None),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs set to true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"logprobs": 1}, "logprobs", "a boolean"),
    ({"logprobs": True, "stream": True}, "logprobs", None),
    ({"stop": ""}, "stop", None),
    ({"seed": "x"}, "seed", "an integer"),
    ({"max_tokens": 1.5}, "max_tokens", "an integer"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", None),
    ({"temperature": "hot"}, "temperature", "a number"),
    ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options", None),
]
COMPLETION_REFUSED = [
    ({"best_of": 2}, "best_of", None),
    ({"suffix": "end"}, "suffix", None),
    ({"echo": True, "logprobs": 1}, "echo", None),
    ({"logprobs": True}, "logprobs", "an integer"),
    ({"prompt": [300]}, "prompt", "token ids"),
    ({"prompt": [-1]}, "prompt", "token ids"),
    ({"prompt": []}, "prompt", None),
    ({"prompt": ["a", 3]}, "prompt", None),
    ({"prompt": ["a"] * 65, "n": 2}, "n", None),
    ({"top_logprobs": 2}, "top_logprobs", "unrecognized"),
]


@pytest.mark.parametrize(("extra", "param", "says"), CHAT_REFUSED)
def test_chat_parameters_it_cannot_honour_are_a_400_naming_them(server, client, extra, param, says) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert says is None or says in err["message"], err["message"]


@pytest.mark.parametrize(("extra", "param", "says"), COMPLETION_REFUSED)
def test_completion_parameters_it_cannot_honour_are_a_400_naming_them(server, extra, param, says) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert says is None or says in err["message"], err["message"]


def test_the_openai_client_sees_the_refused_parameter(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias={"7": 5})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, best_of=3)
    assert e.value.param == "best_of"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, best_of=2, n=2, max_tokens=2)
    assert len(ok.choices) == 2


def test_a_refused_token_id_leaves_other_requests_alone(server, client) -> None:
    """A bad id would fail the whole step in the model; it is refused before it gets there."""
    base = server[0]
    bad = httpx.post(
        base + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [1, 9999]]}, timeout=30
    )
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "prompt"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_the_engine_refuses_a_token_id_outside_the_vocabulary(server) -> None:
    tokenizer = server[2]
    with Engine(tiny_model(tokenizer), tokenizer, device_tokens=256, host_tokens=256) as engine:
        with pytest.raises(ConfigError, match=r"token ids must be in \[0, 300\), got 300"):
            engine.submit([1, 2, 300])
        assert not engine.busy
        assert engine.generate([1, 2, 299], SamplingParams(max_tokens=2)).tokens
