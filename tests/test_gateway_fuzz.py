"""Fuzz the gateway's HTTP endpoints the way tests/test_fuzz.py fuzzes the daemon's frames: random bytes, random
JSON values, valid requests with one field given a random value, deep nesting and huge bodies, on every generating
route (OpenAI's chat, completions and Responses, Anthropic's Messages). Every answer must be below 500, every 4xx
must carry the route's own error body (Anthropic's on /v1/messages, OpenAI's elsewhere), and the gateway must
still answer a good request after."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .daemon_process import DaemonProcess
from .gateway_process import WAIT_S, GatewayProcess, client_of

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
MESSAGES_ROUTE = "/v1/messages"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
MESSAGE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSE_FIELDS = [
    *RESPONSE,
    *("instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "temperature", "top_p", "metadata"),
    *("store", "previous_response_id", "stream", "user", "include", "reasoning", "background", "truncation"),
    "unknown",
]
MESSAGE_FIELDS = [
    *MESSAGE,
    *("system", "stop_sequences", "temperature", "top_p", "top_k", "stream", "tools", "tool_choice", "metadata"),
    *("thinking", "service_tier", "unknown"),
]
CHAT_FIELDS = [
    *CHAT,
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "n",
    "stop",
    "stream",
    "stream_options",
    "seed",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repeat_penalty",
    "repeat_last_n",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "user",
    "prompt_cache_key",
    "service_tier",
    "store",
    "metadata",
    "modalities",
    "max_completion_tokens",
    "safety_identifier",
    "unknown",
]
COMPLETION_FIELDS = [
    *COMPLETION,
    "echo",
    "logprobs",
    "best_of",
    "suffix",
    "n",
    "stop",
    "stream",
    "seed",
    "logit_bias",
    "response_format",
    "temperature",
    "user",
    "unknown",
]
BODIES = dict(zip(ROUTES, (CHAT, COMPLETION, RESPONSE, MESSAGE), strict=True))
FIELDS = dict(zip(ROUTES, (CHAT_FIELDS, COMPLETION_FIELDS, RESPONSE_FIELDS, MESSAGE_FIELDS), strict=True))
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["user", "assistant", "tool", "function", "text", "json_schema", "auto", "required", "none"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def gateway(tiny_model: Path) -> Iterator[GatewayProcess]:
    root = Path(tempfile.mkdtemp(prefix="kvp-"))
    daemon = DaemonProcess(root / "d", tiny_model, "--hot-slots", "4", "--context-size", "2048", "--threads", "2")
    gateway = GatewayProcess(root / "gw", daemon.address)
    try:
        daemon.start()
        gateway.start()
        yield gateway
    finally:
        gateway.stop()
        daemon.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def answered_well(reply: httpx.Response, route: str = "") -> None:
    """Below 500, and a refusal says why in the route's form (Anthropic's on /v1/messages, else OpenAI's)."""
    assert reply.status_code < 500, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        body = reply.json()
        error = body["error"]
        if route == MESSAGES_ROUTE:
            assert body["type"] == "error" and error["type"] and isinstance(error["message"], str) and error["message"]
        else:
            assert isinstance(error["message"], str) and error["message"] and error["type"] and error["code"]


def post(gateway: GatewayProcess, route: str, content: bytes) -> httpx.Response:
    return httpx.post(
        gateway.url + route, content=content, headers={"content-type": "application/json"}, timeout=WAIT_S
    )


@SETTINGS
@given(body=st.binary(max_size=200), route=st.sampled_from(ROUTES))
def test_random_bytes(gateway: GatewayProcess, body: bytes, route: str) -> None:
    answered_well(post(gateway, route, body), route)


@SETTINGS
@given(value=json_values, route=st.sampled_from(ROUTES))
def test_random_json_values(gateway: GatewayProcess, value: Any, route: str) -> None:
    answered_well(post(gateway, route, json.dumps(value).encode()), route)


@SETTINGS
@given(data=st.data(), route=st.sampled_from(ROUTES))
def test_one_field_with_a_random_value(gateway: GatewayProcess, data: st.DataObject, route: str) -> None:
    body: dict[str, Any] = dict(BODIES[route])
    field = data.draw(st.sampled_from(FIELDS[route]))
    body[field] = data.draw(json_values)
    if field in LENGTHS and isinstance(body[field], int) and body[field] > 2:
        body[field] = 2  # a valid length would only make the run long
    answered_well(post(gateway, route, json.dumps(body).encode()), route)


@SETTINGS
@given(data=st.data())
def test_random_messages_and_tools(gateway: GatewayProcess, data: st.DataObject) -> None:
    """Deeper inside chat: messages and tools of the right outer shape with random parts."""
    message = data.draw(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
            optional={
                "content": json_values,
                "tool_calls": json_values,
                "tool_call_id": json_values,
                "name": json_values,
            },
        )
    )
    tool = {
        "type": "function",
        "function": data.draw(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "g", "bad name!"])},
                optional={"parameters": json_values, "description": json_values, "strict": json_values},
            )
        ),
    }
    body = {**CHAT, "messages": [message], "tools": [tool], "tool_choice": data.draw(json_values | st.just("required"))}
    answered_well(post(gateway, ROUTES[0], json.dumps(body).encode()))


@pytest.mark.parametrize("route", ROUTES)
def test_deep_nesting_and_huge_bodies(gateway: GatewayProcess, route: str) -> None:
    deep = 100_000
    arrays = b"[" * deep + b"]" * deep
    objects = b'{"a":' * deep + b"1" + b"}" * deep
    base = BODIES[route]
    for nested in (arrays, objects):
        answered_well(post(gateway, route, nested), route)
        for field in ("prompt", "messages", "input", "tools", "stop", "unknown", "response_format", "logit_bias"):
            head = json.dumps({k: v for k, v in base.items() if k != field})[:-1].encode()
            answered_well(post(gateway, route, head + b', "' + field.encode() + b'": ' + nested + b"}"), route)
    if route in (ROUTES[2], MESSAGES_ROUTE):  # (the schema, size and type checks below are the chat routes')
        huge = post(gateway, route, b'{"input": "' + b"x" * (5 << 20) + b'"}')
        assert huge.status_code == 413
        return
    # a schema nested deep, but not beyond what JSON parsing takes
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    format_ = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    reply = post(gateway, route, json.dumps({**base, "response_format": format_}).encode())
    answered_well(reply)
    assert reply.status_code == 400 and "nested" in reply.json()["error"]["message"]
    huge = post(gateway, route, b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "too_large"
    wrong = post(gateway, route, json.dumps({**base, "model": 5, "max_tokens": "many"}).encode())
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] in ("model", "max_tokens")


def test_other_paths_and_methods(gateway: GatewayProcess) -> None:
    for method, path in (
        ("GET", "/v1/completions"),
        ("DELETE", "/v1/models"),
        ("POST", "/v1/embeddings"),
        ("PUT", "/status"),
        ("GET", "/v1/../etc/passwd"),
    ):
        answered_well(httpx.request(method, gateway.url + path, content=b"{]", timeout=WAIT_S))
    answered_well(httpx.get(gateway.url + "/v1/models", params={"x": "[" * 1000}, timeout=WAIT_S))


def test_the_gateway_still_answers_after_the_storm(gateway: GatewayProcess) -> None:
    reply = client_of(gateway).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert reply.usage.completion_tokens == 3
    assert "Traceback" not in gateway.log()  # nothing failed inside, even answered
