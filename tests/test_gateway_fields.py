"""Every field of OpenAI's chat-completions and completions requests (and llama-server's sampler extensions) is
either honoured, with a check below that shows its effect, or refused with a 400 whose message and `param` name it.
The lists of checks must cover exactly the fields the gateway's request Structs declare, so a field added there
cannot go untested. Real parts: the `openai` client, a kvpool-gateway process, kvpoold on the tiny model (random
weights, one token per byte: token id = 3 + the byte)."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvpool.gateway.schema import ChatCompletionRequest, CompletionRequest

from .daemon_process import DaemonProcess, wait_until
from .gateway_process import WAIT_S, GatewayProcess, client_of, metric
from .test_speculative import FLOAT_TIE

REPEATS = "a b c"  # a prompt whose greedy answer repeats a token (the penalties change it)
Z = 3 + ord("Z")  # the tiny model's token for "Z"
NO_END = {"2": -100}  # the end-of-sequence token banned: a hot sampler's answers run their full length
SCHEMA = {
    "type": "object",
    # ASCII strings: the tiny model's byte tokens can spell ill-formed UTF-8, which the grammar counts differently
    # than a validator does after decoding (see the report of issue #23)
    "properties": {
        "word": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["word", "n"],
}
LIGHT = {
    "type": "function",
    "function": {
        "name": "set_light",
        "description": "Switch the light",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}
VOLUME = {
    "type": "function",
    "function": {
        "name": "set_volume",
        "parameters": {
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10}},
            "required": ["level"],
        },
    },
}


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[tuple[DaemonProcess, GatewayProcess]]:
    """One daemon and one gateway for the whole walk (each field's check is a few short requests)."""
    root = Path(tempfile.mkdtemp(prefix="kvp-"))
    daemon = DaemonProcess(root / "d", tiny_model, "--hot-slots", "4", "--context-size", "4096", "--threads", "2")
    gateway = GatewayProcess(root / "gw", daemon.address)
    try:
        daemon.start()
        gateway.start()
        yield daemon, gateway
    finally:
        gateway.stop()
        daemon.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Api:
    """One of the two routes, asked the same way: ``ask(**fields)`` -> (the first choice's text, the response)."""

    gateway: GatewayProcess
    chat: bool
    start_gateway: Callable[..., GatewayProcess]
    daemon: DaemonProcess

    @property
    def client(self) -> openai.OpenAI:
        return client_of(self.gateway)

    def create(self, client: openai.OpenAI | None = None, content: str = REPEATS, **fields: Any) -> Any:
        client = client or self.client
        fields = {"model": "tiny", "temperature": 0.0, "max_tokens": 8, **fields}
        create = client.chat.completions.create if self.chat else client.completions.create
        known = inspect.signature(create).parameters
        extra = {k: fields.pop(k) for k in list(fields) if k not in known}
        where = {"messages": [{"role": "user", "content": content}]} if self.chat else {"prompt": content}
        if "messages" in fields or "prompt" in fields:
            where = {}
        return create(**where, **fields, extra_body=extra or None)

    def ask(self, content: str = REPEATS, **fields: Any) -> tuple[str, Any]:
        reply = self.create(content=content, **fields)
        choice = reply.choices[0]
        return (choice.message.content if self.chat else choice.text), reply

    def refused(self, field: str, value: Any, mentions: str = "") -> None:
        """A request with ``field`` = ``value`` is a 400 whose message and param name the field."""
        body: dict[str, Any] = {"model": "tiny", field: value}
        if field not in ("messages", "prompt"):
            body["messages" if self.chat else "prompt"] = [{"role": "user", "content": "hi"}] if self.chat else "hi"
        route = "/v1/chat/completions" if self.chat else "/v1/completions"
        reply = httpx.post(self.gateway.url + route, json=body, timeout=WAIT_S)
        assert reply.status_code == 400, (field, reply.status_code, reply.text)
        error = reply.json()["error"]
        assert error["param"] and re.split(r"[.\[]", error["param"])[0] == field, error
        assert field in error["message"] and mentions in error["message"], error


# ---------------------------------------------------------------------- checks shared by both routes


def check_model(api: Api) -> None:
    """Any name is served (one model), and answers carry the served model's id."""
    plain, _ = api.ask()
    for name in ("gpt-4o", "tiny", "my-robot"):
        text, reply = api.ask(model=name)
        assert reply.model == "tiny" and text == plain


def check_frequency_penalty(api: Api) -> None:
    check_penalty(api, frequency_penalty=2.0)


def check_presence_penalty(api: Api) -> None:
    check_penalty(api, presence_penalty=2.0)


def check_repeat_penalty(api: Api) -> None:
    check_penalty(api, repeat_penalty=1.5)


def check_penalty(api: Api, **penalty: float) -> None:
    plain, _ = api.ask(max_tokens=16)
    assert len(set(plain)) < len(plain), "the check needs an answer that repeats a token"
    penalised, _ = api.ask(max_tokens=16, **penalty)
    assert penalised != plain


def check_repeat_last_n(api: Api) -> None:
    plain, _ = api.ask(max_tokens=16)
    assert api.ask(max_tokens=16, repeat_penalty=1.5, repeat_last_n=0)[0] == plain  # no window: no penalty
    assert api.ask(max_tokens=16, repeat_penalty=1.5, repeat_last_n=64)[0] != plain


def check_logit_bias(api: Api) -> None:
    text, _ = api.ask(logit_bias={str(Z): 100})
    assert text == "Z" * 8
    api.refused("logit_bias", {"not-a-token": 5})
    api.refused("logit_bias", {"999999": 5})
    api.refused("logit_bias", {str(Z): 5, f"0{Z}": -5})  # (two keys for one token: one would be dropped)


def check_max_tokens(api: Api) -> None:
    _, reply = api.ask(max_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def check_n(api: Api) -> None:
    reply = api.create(n=3, temperature=1.5, seed=4, max_tokens=12, logit_bias=NO_END)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content if api.chat else c.text for c in reply.choices]
    assert len(set(texts)) > 1, texts  # each choice samples with its own seed (the request's + its index)
    assert reply.usage.completion_tokens == 36
    api.refused("n", 9)


def check_seed(api: Api) -> None:
    first, _ = api.ask(temperature=1.5, seed=5, max_tokens=12)
    assert api.ask(temperature=1.5, seed=5, max_tokens=12)[0] == first
    assert len({api.ask(temperature=1.5, seed=s, max_tokens=12)[0] for s in range(4)}) > 1


def check_stop(api: Api) -> None:
    plain, _ = api.ask(max_tokens=16)
    cut = next(ch for ch in plain[2:] if (ch.isascii() and ch.isalnum()) or ch in "]~")
    text, reply = api.ask(max_tokens=16, stop=[cut])
    assert text == plain[: plain.index(cut)] and reply.choices[0].finish_reason == "stop"
    # Where the answer is JSON a grammar shapes, a stop string could only cut it and read as finished: refused.
    shaped: list[dict[str, Any]] = [{"response_format": {"type": "json_object"}}]
    if api.chat:
        shaped += [{"tools": [LIGHT]}, {"tools": [LIGHT], "tool_choice": "required"}]
    for extra in shaped:
        body = {"model": "tiny", "stop": ["}"], **extra}
        body["messages" if api.chat else "prompt"] = [{"role": "user", "content": "hi"}] if api.chat else "hi"
        route = "/v1/chat/completions" if api.chat else "/v1/completions"
        reply = httpx.post(api.gateway.url + route, json=body, timeout=WAIT_S)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "stop", reply.text
    if api.chat:  # (tools offered but not to be called: the answer is text, and the stop string is honoured)
        text, reply = api.ask(max_tokens=16, stop=[cut], tools=[LIGHT], tool_choice="none")
        assert text == plain[: plain.index(cut)] and reply.choices[0].finish_reason == "stop"


def check_stream(api: Api) -> None:
    plain, _ = api.ask()
    pieces = []
    for chunk in api.create(stream=True):
        for choice in chunk.choices:
            pieces.append((choice.delta.content if api.chat else choice.text) or "")
    assert "".join(pieces) == plain


def check_stream_options(api: Api) -> None:
    chunks = list(api.create(stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    assert all(chunk.usage is None for chunk in chunks[:-1])
    api.refused("stream_options", {"include_usage": True})  # without stream


def check_temperature(api: Api) -> None:
    greedy, _ = api.ask(max_tokens=12)
    assert api.ask(max_tokens=12, temperature=0.0)[0] == greedy
    assert any(api.ask(max_tokens=12, temperature=1.5, seed=s)[0] != greedy for s in range(3))


def greedy_at_high_temperature(api: Api, **field: float) -> None:
    """A sampler setting that keeps only the most likely token makes a hot, seeded sampler answer greedily."""
    greedy, _ = api.ask(max_tokens=12)
    assert any(api.ask(max_tokens=12, temperature=1.5, seed=s)[0] != greedy for s in range(3))
    assert all(api.ask(max_tokens=12, temperature=1.5, seed=s, **field)[0] == greedy for s in range(3))


def check_top_p(api: Api) -> None:
    greedy_at_high_temperature(api, top_p=1e-6)


def check_top_k(api: Api) -> None:
    greedy_at_high_temperature(api, top_k=1)


def check_min_p(api: Api) -> None:
    greedy_at_high_temperature(api, min_p=1.0)


def check_typical_p(api: Api) -> None:
    answers = [api.ask(max_tokens=12, temperature=1.5, seed=s)[0] for s in range(3)]
    typical = [api.ask(max_tokens=12, temperature=1.5, seed=s, typical_p=0.2)[0] for s in range(3)]
    assert typical != answers


def check_user(api: Api) -> None:
    check_fairness_key(api, "user")


def check_prompt_cache_key(api: Api) -> None:
    first_text, first = api.ask(prompt_cache_key="walk", content="first turn")
    if api.chat:
        messages = [
            {"role": "user", "content": "first turn"},
            {"role": "assistant", "content": first_text},
            {"role": "user", "content": "second turn"},
        ]
        _, second = api.ask(messages=messages, prompt_cache_key="walk")
    else:
        _, second = api.ask(content="first turn" + first_text + " second", prompt_cache_key="walk")
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + 8
    # a conversation continues from one answer to a text: n choices (the client picks one) or token ids cannot
    route = "/v1/chat/completions" if api.chat else "/v1/completions"
    where = {"messages": [{"role": "user", "content": "hi"}]} if api.chat else {"prompt": "hi"}
    cases = [{**where, "n": 2}] + ([] if api.chat else [{"prompt": [1, 70, 71]}])
    for case in cases:
        body = {"model": "tiny", "prompt_cache_key": "x", **case}
        reply = httpx.post(api.gateway.url + route, json=body, timeout=WAIT_S)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_cache_key"


def check_response_format(api: Api) -> None:
    for response_format, schema in (
        ({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}, SCHEMA),
        ({"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": False}}, SCHEMA),
    ):
        text, reply = api.ask(response_format=response_format, max_tokens=200, temperature=1.0, seed=3)
        jsonschema.validate(json.loads(text), schema)
        assert reply.choices[0].finish_reason == "stop"
    # json_object: any object (the bias closes it soon on random weights)
    text, _ = api.ask(response_format={"type": "json_object"}, max_tokens=64, logit_bias={str(3 + ord("}")): 20})
    assert isinstance(json.loads(text), dict)
    plain, _ = api.ask()
    assert api.ask(response_format={"type": "text"})[0] == plain
    api.refused("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})
    described = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "description": "a word"}}
    if api.chat:  # the description is told to the model, in the system message
        bare = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
        _, without = api.ask(response_format=bare, max_tokens=1)
        _, told = api.ask(response_format=described, max_tokens=1)
        assert told.usage.prompt_tokens > without.usage.prompt_tokens + len("Answer in JSON: a word")
    else:
        api.refused("response_format", described, mentions="description")


# ---------------------------------------------------------------------- chat only


def check_messages(api: Api) -> None:
    one, _ = api.ask(content="hello there")
    assert api.ask(content="something else")[0] != one
    api.refused("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    both = {"type": "text", "text": "hi", "image_url": {"url": "data:image/png;base64,AAAA"}}  # (the image unread)
    api.refused("messages", [{"role": "user", "content": [both]}], mentions="image_url")
    said = {  # an assistant turn renders as its calls alone: words beside them would be dropped
        "role": "assistant",
        "content": "Switching it on now.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "set_light", "arguments": "{}"}}],
    }
    api.refused("messages", [{"role": "user", "content": "light"}, said], mentions="content")
    api.create(messages=[{"role": "user", "content": "light"}, {**said, "content": ""}])  # (nothing to drop)
    twice = {**said, "content": None, "tool_calls": said["tool_calls"] * 2}  # (which call would a result answer?)
    api.refused("messages", [{"role": "user", "content": "light"}, twice], mentions="tool_calls[1].id")
    # A participant's name is rendered before its content (the templates render no names): it costs tokens.
    plain = api.create(messages=[{"role": "user", "content": "hi"}]).usage.prompt_tokens
    named = api.create(messages=[{"role": "system", "content": "Be brief.", "name": "rules"},
                                 {"role": "user", "content": "hi", "name": "bob"}]).usage.prompt_tokens  # fmt: skip
    alone = api.create(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert plain < alone.usage.prompt_tokens < named
    api.refused("messages", [{"role": "assistant", "content": "hi", "name": "me"}, {"role": "user", "content": "x"}])
    call = {"id": "c1", "type": "function", "function": {"name": "set_light", "arguments": "{}"}}
    loop = [{"role": "user", "content": "light"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    # A tool result's name is its call's tool, as OpenAI's earlier function-calling examples send it.
    api.create(messages=[*loop, {"role": "tool", "tool_call_id": "c1", "name": "set_light", "content": "on"}])
    api.refused("messages", [*loop, {"role": "tool", "tool_call_id": "c1", "name": "other", "content": "on"}])


def check_max_completion_tokens(api: Api) -> None:
    _, reply = api.ask(max_completion_tokens=5, max_tokens=None)
    assert reply.usage.completion_tokens == 5
    _, reply = api.ask(max_completion_tokens=5, max_tokens=5)
    assert reply.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:  # two limits that differ: neither is dropped unsaid
        api.ask(max_completion_tokens=5, max_tokens=7)
    assert refused.value.body["param"] == "max_tokens" and "max_completion_tokens" in refused.value.message  # type: ignore[index]


def check_logprobs_chat(api: Api) -> None:
    text, reply = api.ask(logprobs=True)
    content = reply.choices[0].logprobs.content
    assert len(content) == 8 and all(e.logprob <= 0 and e.top_logprobs == [] for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == text
    _, plain = api.ask()
    assert plain.choices[0].logprobs is None
    # A stop string's tokens are not the answer's: their entries go with their text, whole and streamed.
    text, reply = api.ask(max_tokens=24, logprobs=True, logit_bias=NO_END)
    stop = next(text[i : i + 2] for i in range(6, len(text) - 1) if text[i : i + 2] not in text[: i + 1])
    cut, reply = api.ask(max_tokens=24, logprobs=True, logit_bias=NO_END, stop=[stop])
    entries = reply.choices[0].logprobs.content
    assert cut == text[: text.index(stop)] and reply.choices[0].finish_reason == "stop"
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == cut
    streamed = [
        e
        for chunk in api.create(max_tokens=24, logprobs=True, logit_bias=NO_END, stop=[stop], stream=True)
        for choice in chunk.choices
        for e in (choice.logprobs.content if choice.logprobs else None) or ()
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=FLOAT_TIE)


def check_prediction(api: Api) -> None:
    """A predicted output is guessed from (the daemon's guesses are on by default) and verified: the answer is the
    one without it, up to a float tie (a step with guessed rows is a batch of another shape), and the usage counts
    the prediction's tokens taken and refused; any other shape of it is refused."""
    plain_text, plain = api.ask(max_tokens=24, logprobs=True)
    assert plain.usage.completion_tokens_details is None  # (no prediction: nothing to count)
    for content in (plain_text, [{"type": "text", "text": plain_text[:9]}, {"type": "text", "text": plain_text[9:]}]):
        _, reply = api.ask(max_tokens=24, logprobs=True, prediction={"type": "content", "content": content})
        for a, b in zip(plain.choices[0].logprobs.content, reply.choices[0].logprobs.content, strict=True):
            assert abs(a.logprob - b.logprob) < FLOAT_TIE, (a, b)
            if a.token != b.token:
                break
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0, details
    api.refused("prediction", {"type": "content", "content": 5}, "expected answer")
    api.refused("prediction", {"type": "image", "content": "x"}, "expected answer")
    # Longer than the answer can be (the daemon's 4096-token context; a byte a token): the field, not a session id.
    api.refused("prediction", {"type": "content", "content": "a" * 5000}, "room for")


def check_top_logprobs(api: Api) -> None:
    _, reply = api.ask(logprobs=True, top_logprobs=3)
    for entry in reply.choices[0].logprobs.content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
    api.refused("top_logprobs", 3)  # without logprobs


def check_tools(api: Api) -> None:
    _, reply = api.ask(tools=[LIGHT, VOLUME], tool_choice="required", max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
        tool = {"set_light": LIGHT, "set_volume": VOLUME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    api.refused("tools", [{"type": "custom", "custom": {"name": "x"}}])


def check_tool_choice(api: Api) -> None:
    for _ in range(2):
        named = {"type": "function", "function": {"name": "set_light"}}
        _, reply = api.ask(tools=[LIGHT, VOLUME], tool_choice=named, max_tokens=100)
        assert {call.function.name for call in reply.choices[0].message.tool_calls} == {"set_light"}
    plain, _ = api.ask()
    text, reply = api.ask(tools=[LIGHT], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and text == plain  # no tools offered: the plain answer
    api.refused("tool_choice", "required")  # without tools


def check_parallel_tool_calls(api: Api) -> None:
    comma = {str(3 + ord(",")): 100}  # after a call, another one
    _, many = api.ask(tools=[LIGHT], tool_choice="required", max_tokens=120, logit_bias=comma)
    assert len(many.choices[0].message.tool_calls) >= 2
    _, one = api.ask(tools=[LIGHT], tool_choice="required", max_tokens=120, logit_bias=comma, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    api.refused("parallel_tool_calls", False)  # without tools


def check_safety_identifier(api: Api) -> None:
    check_fairness_key(api, "safety_identifier")


def check_service_tier(api: Api) -> None:
    for tier in ("auto", "default"):
        _, reply = api.ask(service_tier=tier)
        assert reply.service_tier == "default"
    api.refused("service_tier", "flex")


def check_store(api: Api) -> None:
    plain, _ = api.ask()
    assert api.ask(store=False)[0] == plain
    api.refused("store", True, mentions="stores nothing")


def check_modalities(api: Api) -> None:
    plain, _ = api.ask()
    assert api.ask(modalities=["text"])[0] == plain
    api.refused("modalities", ["text", "audio"])


# ---------------------------------------------------------------------- completions only


def check_prompt(api: Api) -> None:
    text, _ = api.ask(content="a b c")
    with api.daemon.client() as client:
        tokens = client.tokenize("a b c", add_bos=True, special=False)  # as the gateway tokenizes a text prompt
    assert (
        api.ask(prompt=tokens)[0] == text
        and api.ask(prompt=[tokens])[0] == text
        and api.ask(prompt=["a b c"])[0] == text
    )
    api.refused("prompt", ["one", "two"])
    api.refused("prompt", [70, -1], mentions="-1")  # (named as sent, not as the daemon's field)
    api.refused("prompt", [[70, 10**6]], mentions="prompt[0]")


def check_echo(api: Api) -> None:
    text, _ = api.ask()
    assert api.ask(echo=True)[0] == REPEATS + text
    streamed = "".join(c.choices[0].text for c in api.create(echo=True, stream=True) if c.choices)
    assert streamed == REPEATS + text
    body = {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1}
    reply = httpx.post(api.gateway.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"


def check_logprobs_completions(api: Api) -> None:
    _, reply = api.ask(logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs) and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    api.refused("logprobs", 6)
    # The tiny model spells ill-formed UTF-8: tokens that are not whole characters are written as their bytes (two
    # such are two keys), offsets count the text's characters, and a stop string's tokens are left out.
    text, reply = api.ask(max_tokens=24, logprobs=2, logit_bias=NO_END)
    logprobs = reply.choices[0].logprobs
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert b"".join(map(legacy_bytes, logprobs.tokens)).decode("utf-8", "replace") == text
    assert all(0 <= offset < len(text) for offset in logprobs.text_offset)
    stop = next(text[i : i + 2] for i in range(6, len(text) - 1) if text[i : i + 2] not in text[: i + 1])
    cut, reply = api.ask(max_tokens=24, logprobs=2, logit_bias=NO_END, stop=[stop])
    assert cut == text[: text.index(stop)]
    tokens = reply.choices[0].logprobs.tokens
    assert b"".join(map(legacy_bytes, tokens)).decode("utf-8", "replace") == cut
    assert tokens == logprobs.tokens[: len(tokens)]


def legacy_bytes(token: str) -> bytes:
    """A token of the legacy logprobs form as its bytes: its text, or ``bytes:\\xNN...``."""
    if token.startswith("bytes:"):
        return bytes(int(hex_, 16) for hex_ in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


def check_best_of(api: Api) -> None:
    plain, _ = api.ask()
    assert api.ask(best_of=1)[0] == plain
    api.refused("best_of", 2)


# ---------------------------------------------------------------------- fairness keys (the gateway's queue)


def check_fairness_key(api: Api, field: str) -> None:
    """`user` (and `safety_identifier`) name who is asking: the queue's share per key (--queue-per-key) is theirs.
    With one generation in flight and one waiting request per key, a second request of the same key is refused
    (429) while another key's still waits its turn."""
    flags = ("--max-inflight", "1", "--queue-per-key", "1")
    gateway = api.start_gateway(api.daemon.address, *flags, name=f"fair-{field}-{api.chat}")
    fair = Api(gateway, api.chat, api.start_gateway, api.daemon)
    blocker = fair.create(stream=True, max_tokens=1800, **{field: "blocker"})
    next(iter(blocker))  # admitted: the one slot is taken
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(fair.ask, **{field: "alice"})
            wait_until(lambda: metric(gateway, "kvpool_gateway_queue_depth") == 1, "alice's request to wait", WAIT_S)
            with pytest.raises(openai.RateLimitError) as refused:
                fair.ask(**{field: "alice"})
            assert refused.value.response.headers["retry-after"] and "queue-per-key" in refused.value.message
            second = pool.submit(fair.ask, **{field: "bob"})
            wait_until(lambda: metric(gateway, "kvpool_gateway_queue_depth") == 2, "bob's request to wait", WAIT_S)
            blocker.close()
            assert first.result(WAIT_S)[1].usage.completion_tokens == 8
            assert second.result(WAIT_S)[1].usage.completion_tokens == 8
    finally:
        blocker.close()


# ---------------------------------------------------------------------- the walk


def refusal(value: Any, mentions: str = "") -> Callable[[Api, str], None]:
    def check(api: Api, field: str) -> None:
        api.refused(field, value, mentions)

    return check


Check = Callable[..., None]
SHARED: dict[str, Check] = {
    "model": check_model,
    "frequency_penalty": check_frequency_penalty,
    "presence_penalty": check_presence_penalty,
    "logit_bias": check_logit_bias,
    "max_tokens": check_max_tokens,
    "n": check_n,
    "seed": check_seed,
    "stop": check_stop,
    "stream": check_stream,
    "stream_options": check_stream_options,
    "temperature": check_temperature,
    "top_p": check_top_p,
    "user": check_user,
    "prompt_cache_key": check_prompt_cache_key,
    "top_k": check_top_k,
    "min_p": check_min_p,
    "typical_p": check_typical_p,
    "repeat_penalty": check_repeat_penalty,
    "repeat_last_n": check_repeat_last_n,
    "response_format": check_response_format,
}
CHAT: dict[str, Check] = {
    **SHARED,
    "messages": check_messages,
    "audio": refusal({"voice": "alloy", "format": "wav"}),
    "function_call": refusal("auto", "tools"),
    "functions": refusal([{"name": "f", "parameters": {}}], "tools"),
    "logprobs": check_logprobs_chat,
    "max_completion_tokens": check_max_completion_tokens,
    "metadata": refusal({"k": "v"}, "stores nothing"),
    "modalities": check_modalities,
    "moderation": refusal({"model": "omni-moderation-latest"}),
    "parallel_tool_calls": check_parallel_tool_calls,
    "prediction": check_prediction,
    "prompt_cache_options": refusal({"mode": "explicit"}),
    "prompt_cache_retention": refusal("24h"),
    "reasoning_effort": refusal("low"),
    "safety_identifier": check_safety_identifier,
    "service_tier": check_service_tier,
    "store": check_store,
    "tool_choice": check_tool_choice,
    "tools": check_tools,
    "top_logprobs": check_top_logprobs,
    "verbosity": refusal("low"),
    "web_search_options": refusal({}),
}
COMPLETIONS: dict[str, Check] = {
    **SHARED,
    "prompt": check_prompt,
    "best_of": check_best_of,
    "echo": check_echo,
    "logprobs": check_logprobs_completions,
    "suffix": refusal("and then"),
}


def test_the_walk_covers_every_declared_field() -> None:
    assert set(CHAT) == set(ChatCompletionRequest.__struct_fields__)
    assert set(COMPLETIONS) == set(CompletionRequest.__struct_fields__)


def run(check: Check, api: Api, field: str) -> None:
    if len(inspect.signature(check).parameters) == 2:
        check(api, field)
    else:
        check(api)


@pytest.mark.parametrize("field", sorted(CHAT))
def test_chat_field(
    field: str, stack: tuple[DaemonProcess, GatewayProcess], start_gateway: Callable[..., GatewayProcess]
) -> None:
    run(CHAT[field], Api(stack[1], True, start_gateway, stack[0]), field)


@pytest.mark.parametrize("field", sorted(COMPLETIONS))
def test_completions_field(
    field: str, stack: tuple[DaemonProcess, GatewayProcess], start_gateway: Callable[..., GatewayProcess]
) -> None:
    run(COMPLETIONS[field], Api(stack[1], False, start_gateway, stack[0]), field)


def test_stop_strings_past_what_the_template_leaves_are_refused_by_name(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """A template with a stop of its own leaves room for 15: the 16th was accepted by the gateway, then refused by the
    daemon as "Expected array of length <= 16 - at $.stop", with no param."""
    c = client_of(start_gateway(daemon.address, "--chat-template", "transcript"))
    hi = [{"role": "user", "content": "Hi"}]
    stops = [f"s{i}" for i in range(16)]
    with pytest.raises(openai.BadRequestError) as refused:
        c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, stop=stops)  # type: ignore[arg-type]
    body: Any = refused.value.body
    assert body["param"] == "stop" and "at most 15 strings with this chat template" in body["message"], body
    done = c.chat.completions.create(model="tiny", messages=hi, max_tokens=2, stop=stops[:15])  # type: ignore[arg-type]
    assert done.choices[0].finish_reason in ("stop", "length")
