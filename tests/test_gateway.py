"""The OpenAI-compatible gateway: the real `openai` client, a real kvpool-gateway process, a real kvpoold (tiny
model, with the chat template the suite's GGUF carries)."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from kvpool.gateway.conversations import Mapping

from .curve_keys import curve_setup
from .daemon_process import DaemonProcess, wait_until
from .gateway_process import GatewayProcess, client_of

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0, "max_tokens": 8}
WAIT_S = 30.0


def chat(c: openai.OpenAI, messages: list[dict[str, str]], **kw: object) -> openai.types.chat.ChatCompletion:
    return c.chat.completions.create(model="tiny", messages=messages, **GREEDY, **kw)  # type: ignore[arg-type]


def test_models_and_a_chat_answer_streamed_or_not(served: GatewayProcess) -> None:
    c = client_of(served)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    plain = chat(c, messages)
    assert plain.choices[0].finish_reason == "length" and plain.usage is not None
    assert plain.usage.completion_tokens == 8 and plain.usage.prompt_tokens > 10
    stream = c.chat.completions.create(
        model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(pieces) == plain.choices[0].message.content and finish == "length"
    assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_streamed_or_not(served: GatewayProcess) -> None:
    c = client_of(served)
    plain = c.completions.create(model="tiny", prompt="once upon a time", **GREEDY)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in c.completions.create(model="tiny", prompt="once upon a time", stream=True, **GREEDY)
        if chunk.choices
    )
    assert plain.usage is not None and plain.usage.completion_tokens == 8
    assert streamed == plain.choices[0].text


def converse(c: openai.OpenAI, key: str | None, turns: int, between: Callable[[], None] = lambda: None) -> list:
    """A conversation of ``turns`` turns, resent whole each time; returns each turn's (answer, usage)."""
    messages = [{"role": "system", "content": "a robot"}, {"role": "user", "content": "turn 0"}]
    out = []
    for k in range(turns):
        if k:
            between()
        extra = {"prompt_cache_key": key} if key else {}
        reply = chat(c, messages, **extra)
        answer = reply.choices[0].message.content or ""
        out.append((answer, reply.usage))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"turn {k + 1}"}]
    return out


def test_a_conversation_reuses_its_earlier_turns(served: GatewayProcess) -> None:
    turns = converse(client_of(served), "robot-1", 8)
    for k in range(1, 8):
        previous = turns[k - 1][1]
        cached = turns[k][1].prompt_tokens_details.cached_tokens
        assert cached == previous.prompt_tokens + previous.completion_tokens, f"turn {k}"
    assert turns[0][1].prompt_tokens_details.cached_tokens == 0
    # the same conversation again, under its own name, answers the same
    assert [a for a, _ in converse(client_of(served), "robot-2", 8)] == [a for a, _ in turns]


def test_a_conversation_without_a_name_is_found_by_its_history(served: GatewayProcess) -> None:
    turns = converse(client_of(served), None, 4)
    for k in range(1, 4):
        previous = turns[k - 1][1]
        assert turns[k][1].prompt_tokens_details.cached_tokens == previous.prompt_tokens + previous.completion_tokens
    assert [a for a, _ in converse(client_of(served), "named", 4)] == [a for a, _ in turns]


def test_no_reuse_computes_every_turn_in_full(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(daemon.address, "--no-reuse")
    turns = converse(client_of(gateway), "ignored", 3)
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in turns)
    with daemon.client() as client:
        assert client.sessions() == []  # every session was closed with its request


def test_reuse_survives_a_daemon_kill_and_a_gateway_restart(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(daemon.address)
    c = client_of(gateway)
    restarts = iter(["daemon", "gateway", "daemon"])

    def restart() -> None:
        which = next(restarts, None)
        if which == "daemon":
            daemon.stop(signal.SIGKILL)
            daemon.start()
        elif which == "gateway":
            gateway.stop()
            gateway.start()

    turns = converse(c, "survivor", 4, between=restart)
    for k in range(1, 4):
        previous = turns[k - 1][1]
        assert turns[k][1].prompt_tokens_details.cached_tokens == previous.prompt_tokens + previous.completion_tokens
    assert [a for a, _ in converse(c, "never-restarted", 4)] == [a for a, _ in turns]


@pytest.mark.parametrize("killed", ["daemon", "gateway"])
def test_a_turn_cut_by_a_kill_is_sent_again_on_what_the_session_kept(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess], killed: str
) -> None:
    """A daemon killed mid-answer keeps the session as it was before the turn: the turn sent again continues it
    (it was started afresh, its KV thrown away). A gateway killed mid-answer leaves a session holding more than its
    map says: the turn sent again starts afresh (it got a 409 telling an HTTP client to read Session.history())."""
    gateway = start_gateway(daemon.address, "--resume-wait", "0")
    c = client_of(gateway)
    history = [{"role": "user", "content": "hello"}]
    first = chat(c, history, prompt_cache_key="cut")
    assert first.usage is not None
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    stream = c.chat.completions.create(
        model="tiny", messages=history, max_tokens=1500, stream=True, prompt_cache_key="cut", temperature=0.0
    )
    next(iter(stream))  # under way
    if killed == "daemon":
        daemon.stop(signal.SIGKILL)
        daemon.start()
    else:
        assert gateway.proc is not None
        gateway.proc.kill()
        gateway.proc.wait(10)
    with contextlib.suppress(openai.APIError, httpx.HTTPError):
        for _ in stream:
            pass
    if killed == "daemon":  # the stream's 200 went out before the cut: its error event is counted apart
        metrics = httpx.get(gateway.url + "/metrics", timeout=WAIT_S).text
        series = r'^kvpool_gateway_streams_cut_total\{code="(\w+)",route="/v1/chat/completions"\} 1\.0$'
        cut = re.findall(series, metrics, re.M)
        assert len(cut) == 1, metrics
    if killed == "gateway":
        gateway.start()
    again = chat(c, history, prompt_cache_key="cut")  # (a 409 raised here)
    assert again.usage is not None and again.choices[0].message.content
    kept = first.usage.prompt_tokens + first.usage.completion_tokens if killed == "daemon" else 0
    assert again.usage.prompt_tokens_details.cached_tokens == kept


def test_an_edited_history_answers_as_a_fresh_conversation(served: GatewayProcess) -> None:
    c = client_of(served)
    converse(c, "editable", 3)
    edited = [{"role": "system", "content": "a robot"}, {"role": "user", "content": "something else entirely"}]
    again = chat(c, edited, prompt_cache_key="editable")
    fresh = chat(c, edited)
    assert again.choices[0].message.content == fresh.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("key", [None, "cross-route"])
def test_a_conversation_continues_only_on_a_route_that_tokenizes_it_alike(
    served: GatewayProcess, key: str | None
) -> None:
    """A completion's prompt is tokenized as text (its `<s>` three bytes), a chat's rendering with its special
    tokens (`<s>` the BOS token): a chat whose history is a completion's text and answer is the same text and other
    tokens, so it does not continue the completion's session (named or found by its history); it answers as fresh."""
    c = client_of(served)
    named = {"prompt_cache_key": key} if key else {}
    z = {str(3 + ord("Z")): 100.0}  # (the tiny model's token for "Z")
    done = c.completions.create(
        model="tiny",
        prompt="<s>[user] cross route\n[assistant] ",
        temperature=0.0,
        max_tokens=8,
        logit_bias=z,
        extra_body=named,
    )  # (the tiny template's rendering of the chat's first turn, below)
    assert done.choices[0].text == "Z" * 8
    # The control: the chat's first turn renders as that prompt, `<s>` read as BOS (one token) and not as three
    # bytes after the BOS a completion gets.
    first = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "cross route"}], max_tokens=1, prompt_cache_key="control"
    )
    assert done.usage is not None and first.usage is not None
    assert first.usage.prompt_tokens == done.usage.prompt_tokens - 3
    history = [
        {"role": "user", "content": "cross route"},
        {"role": "assistant", "content": "Z" * 8},
        {"role": "user", "content": "more"},
    ]
    continued = chat(c, history, **named)
    fresh = chat(c, history, prompt_cache_key=f"fresh-{key}")
    assert continued.usage is not None and fresh.usage is not None
    assert continued.usage.prompt_tokens_details.cached_tokens == 0
    assert continued.usage.prompt_tokens == fresh.usage.prompt_tokens
    assert continued.choices[0].message.content == fresh.choices[0].message.content


def test_a_conversation_map_of_an_older_gateway_continues_nothing() -> None:
    """A mapping an older gateway wrote does not say how its text was tokenized: no route continues it (its session
    is closed or replaced, a prefill more), rather than one that tokenizes it otherwise."""
    old = {"session": "s1", "token": "t1", "held": None}
    assert Mapping.from_json(old).special is None
    for special in (True, False):
        assert Mapping.from_json(Mapping("s1", "t1", None, special).to_json()).special is special


def test_two_conversations_interleaved_stay_apart(served: GatewayProcess) -> None:
    c = client_of(served)
    alone = converse(c, "alone", 3)
    histories = {
        key: [{"role": "system", "content": "a robot"}, {"role": "user", "content": "turn 0"}] for key in ("x", "y")
    }
    answers: dict[str, list[str]] = {"x": [], "y": []}
    for k in range(3):
        for key in ("x", "y"):
            reply = chat(c, histories[key], prompt_cache_key=key)
            answer = reply.choices[0].message.content or ""
            answers[key].append(answer)
            histories[key] += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"turn {k + 1}"}]
    assert answers["x"] == answers["y"] == [a for a, _ in alone]


def test_a_body_that_never_arrives_whole_is_answered_408(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """A client that sends 10 of the 100 bytes it announced held its connection and its bytes for ever (30 such
    held 130 MiB of the gateway's memory)."""
    gateway = start_gateway(daemon.address, "--body-timeout", "1")
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        slow.sendall((head + "Content-Length: 100\r\n\r\n").encode() + b'{"model": ')
        answer = b""
        while b"--body-timeout" not in answer and (piece := slow.recv(4096)):  # (bounded by the socket's timeout)
            answer += piece
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive whole within 1 s" in answer, answer[:400]
    assert chat(client_of(gateway), [{"role": "user", "content": "hi"}]).choices[0].message.content is not None


def test_errors_are_openai_errors_with_the_right_status(served: GatewayProcess) -> None:
    c = client_of(served)
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="frobnicate") as unknown:
        chat(c, hello, extra_body={"frobnicate": 1})
    assert unknown.value.body["param"] == "frobnicate"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="n") as too_many:
        chat(c, hello, n=9)
    assert too_many.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="context") as overflow:
        chat(c, [{"role": "user", "content": "x " * 3000}])  # longer than the session's context
    assert overflow.value.code == "context_length_exceeded"  # OpenAI's name, which clients match on
    url = served.url + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    wrong_type = httpx.post(url, json={"model": "tiny", "messages": "hello"})
    assert wrong_type.status_code == 400 and "messages" in wrong_type.json()["error"]["message"]
    too_large = httpx.post(url, content=b"x" * (5 << 20), headers={"content-type": "application/json"})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "too_large"
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/chat/completions", 405)):
        reply = httpx.request(method, served.url + path)
        assert reply.status_code == status and reply.json()["error"]["message"]
    assert httpx.get(served.url + "/health").json()["ok"] is True


def test_any_model_name_is_served_and_aliases_are_listed(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """llama-server's convention with one model: whatever name a client sends is answered (many send a fixed one);
    answers carry the served model's id, and --alias names are listed with it."""
    gateway = start_gateway(daemon.address, "--alias", "gpt-4o-mini", "--alias", "robot")
    c = client_of(gateway)
    [listed] = c.models.list().data
    assert listed.id == "tiny" and listed.model_extra["aliases"] == ["gpt-4o-mini", "robot"]
    for name in ("gpt-4", "robot", "anything at all"):
        reply = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], **GREEDY)
        assert reply.model == "tiny" and reply.usage.completion_tokens == 8


def test_an_api_key_is_required_when_set(daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]) -> None:
    gateway = start_gateway(daemon.address, "--api-key", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        client_of(gateway, api_key="wrong").models.list()
    assert [m.id for m in client_of(gateway, api_key="s3cret").models.list().data] == ["tiny"]


def test_cors_lets_in_the_origins_it_names_and_only_those(
    daemon: DaemonProcess, start_gateway: Callable[..., GatewayProcess]
) -> None:
    """A page served elsewhere may call the gateway once --cors-origins names its origin: preflights are answered
    (no key needed for them), every answer to that origin carries the header, errors included."""
    page, other = "http://127.0.0.1:8765", "http://127.0.0.1:9999"
    gateway = start_gateway(daemon.address, "--cors-origins", page, "--api-key", "k")
    url = gateway.url + "/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    preflight = httpx.options(url, headers={"Origin": page, **ask})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
    assert "POST" in preflight.headers["access-control-allow-methods"]
    answer = httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        headers={"Origin": page, "Authorization": "Bearer k"})  # fmt: skip
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == page
    unauthorised = httpx.get(gateway.url + "/v1/models", headers={"Origin": page})
    assert unauthorised.status_code == 401 and unauthorised.headers["access-control-allow-origin"] == page
    refused = httpx.options(url, headers={"Origin": other, **ask})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert "access-control-allow-origin" not in httpx.get(gateway.url + "/health", headers={"Origin": other}).headers
    closed = start_gateway(daemon.address, name="closed")  # none by default: no page elsewhere gets in
    assert httpx.options(closed.url + "/v1/chat/completions", headers={"Origin": page, **ask}).status_code == 405


def test_binding_beyond_loopback_without_a_key_is_refused(short_tmp: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.gateway.main", "--host", "0.0.0.0", "--daemon", "ipc:///nonexistent"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 2 and "without a key" in done.stderr and "--api-key" in done.stderr


def test_the_gateway_reaches_a_curve_daemon_over_tcp(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess], short_tmp: Path
) -> None:
    curve = curve_setup(short_tmp / "curve")
    start_daemon("--address", curve.address, config=curve.daemon_config, wait=False)
    keys = ("--curve-server-key", str(curve.server_public_file), "--curve-client-key", str(curve.client_secret_file))
    gateway = start_gateway(curve.address, *keys)
    wait_until(lambda: httpx.get(gateway.url + "/health", timeout=WAIT_S).status_code == 200, "the daemon over tcp")
    answer = chat(client_of(gateway), [{"role": "user", "content": "over curve"}])
    assert answer.choices[0].message.content is not None and answer.usage.completion_tokens == 8
    without = subprocess.run(  # a tcp:// daemon without keys: refused at start, with the flags to pass
        [sys.executable, "-m", "kvpool.gateway.main", "--daemon", curve.address], capture_output=True, text=True
    )
    assert without.returncode == 2 and "--curve-server-key" in without.stderr
    stranger = (
        *("--curve-server-key", str(curve.server_public_file)),
        *("--curve-client-key", str(curve.stranger_secret_file)),
    )
    unlisted = start_gateway(curve.address, *stranger, "--timeout", "2", name="gw-stranger")
    assert httpx.get(unlisted.url + "/health", timeout=WAIT_S).status_code == 503  # never let in


def test_a_daemon_that_is_down_is_a_503(short_tmp: Path, start_gateway: Callable[..., GatewayProcess]) -> None:
    gateway = start_gateway(f"ipc://{short_tmp / 'no-daemon.sock'}")
    reply = httpx.post(
        gateway.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert reply.status_code == 503 and "kvpoold" in reply.json()["error"]["message"]
    assert reply.headers.get("retry-after") == "1"


def test_a_client_that_goes_away_mid_stream_cancels_its_generation(
    daemon: DaemonProcess, served: GatewayProcess
) -> None:
    c = client_of(served)
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=1800, stream=True
    )
    next(iter(stream))
    with daemon.client() as watcher:
        assert watcher.status().sessions.generating == 1
        stream.close()
        wait_until(lambda: not watcher.status().sessions.generating, "the generation to stop", WAIT_S)
        status = watcher.status()
        assert status.sessions.generating == 0 and status.counters.finished.get("cancelled") == 1


def test_a_streamed_conversation_reuses_its_earlier_turns(served: GatewayProcess) -> None:
    """A client reads [DONE] and sends its next turn at once: the gateway must have recorded the turn by then
    (its stream is cancelled when the client closes the connection)."""
    c = client_of(served)
    messages = [{"role": "user", "content": "turn 0"}]
    usages = []
    for k in range(4):
        stream = c.chat.completions.create(
            model="tiny",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            prompt_cache_key="streamed",
            **GREEDY,
        )
        pieces, usage = [], None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert usage is not None
        usages.append(usage)
        messages += [{"role": "assistant", "content": "".join(pieces)}, {"role": "user", "content": f"turn {k + 1}"}]
    for k in range(1, 4):
        previous = usages[k - 1]
        assert usages[k].prompt_tokens_details.cached_tokens == previous.prompt_tokens + previous.completion_tokens


def test_a_full_queue_is_a_429_with_retry_after(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon("--context-size", "4096", config="[tasks.default]\nmax_queue = 1\n")
    gateway = start_gateway(daemon.address)
    c = client_of(gateway)
    busy = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=1800, stream=True
    )
    next(iter(busy))  # generating: the task's one place is taken
    try:
        reply = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "me too"}], "max_tokens": 2},
            timeout=WAIT_S,
        )
        assert reply.status_code == 429 and reply.headers.get("retry-after") == "1"
        assert reply.json()["error"]["code"] == "overloaded" and "max_queue" in reply.json()["error"]["message"]
    finally:
        busy.close()


def test_a_conversation_changed_behind_the_gateways_back_is_a_409(
    daemon: DaemonProcess, served: GatewayProcess
) -> None:
    import json

    c = client_of(served)
    first = chat(c, [{"role": "user", "content": "hi"}], prompt_cache_key="shared")
    mapping = json.loads(served.state_file.read_text())["shared"]
    with daemon.client() as other:  # another program, holding the session's capability token, adds a turn
        other.resume_session(mapping["session"], mapping["token"]).complete("sneaky", max_tokens=2)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.choices[0].message.content}]
    with pytest.raises(openai.ConflictError, match="another request changed it"):
        chat(c, [*history, {"role": "user", "content": "next"}], prompt_cache_key="shared")


def test_two_requests_on_one_conversation_at_once_take_turns(served: GatewayProcess) -> None:
    from concurrent.futures import ThreadPoolExecutor

    c = client_of(served)
    history = [{"role": "user", "content": "both at once"}]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: chat(c, history, prompt_cache_key="twice"), range(2)))
    answers = {r.choices[0].message.content for r in replies}
    assert len(answers) == 1  # the same history gives the same answer, whichever ran first
    # the conversation goes on from that answer, on a session that holds exactly it
    follow = chat(c, [*history, {"role": "assistant", "content": answers.pop()}, {"role": "user", "content": "go"}],
                  prompt_cache_key="twice")  # fmt: skip
    assert follow.usage is not None and follow.usage.prompt_tokens_details.cached_tokens > 0


def test_a_conversation_whose_session_expired_starts_over(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon("--session-timeout", "1")
    gateway = start_gateway(daemon.address)
    c = client_of(gateway)
    first = chat(c, [{"role": "user", "content": "remember me"}], prompt_cache_key="fleeting")
    with daemon.client() as watcher:
        wait_until(lambda: not watcher.sessions(), "the daemon to expire the session", WAIT_S)
        assert watcher.sessions() == []
    history = [
        {"role": "user", "content": "remember me"},
        {"role": "assistant", "content": first.choices[0].message.content},
    ]
    again = chat(c, [*history, {"role": "user", "content": "still there?"}], prompt_cache_key="fleeting")
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == 0


def test_requests_without_a_name_never_run_the_daemon_out_of_sessions(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon("--max-sessions", "4")
    gateway = start_gateway(daemon.address)
    c = client_of(gateway)
    for i in range(8):  # distinct histories: each keeps a session of its own, until room runs out
        assert chat(c, [{"role": "user", "content": f"stranger {i}"}]).choices[0].message.content is not None
    with daemon.client() as watcher:
        assert 1 <= len(watcher.sessions()) <= 4


def test_restarted_gateways_never_strand_the_sessions_of_requests_without_a_name(
    start_daemon: Start, short_tmp: Path
) -> None:
    """Each gateway, stopped or killed, leaves its sessions recorded next to its conversation map: the next one
    continues or closes them, so the daemon never fills up with sessions nobody can reach. 100 gateways, with
    traffic in between; the 101st answers at once."""
    daemon = start_daemon("--max-sessions", "8")  # a gateway keeps 2 (a quarter) for requests without a name
    for i in range(100):
        gateway = GatewayProcess(short_tmp / "gw", daemon.address)
        try:
            gateway.start()
            reply = chat(client_of(gateway), [{"role": "user", "content": f"stranger number {i}"}])
            assert reply.choices[0].message.content is not None
        finally:
            if i % 2 and gateway.proc is not None:
                gateway.proc.kill()  # no shutdown at all
                gateway.proc.wait(10)
            gateway.stop()
        with daemon.client() as watcher:
            assert len(watcher.sessions()) <= 2, f"after gateway {i}"  # the bound: a quarter of max_sessions
    last = GatewayProcess(short_tmp / "gw", daemon.address).start()
    try:
        assert chat(client_of(last), [{"role": "user", "content": "the last one"}]).choices[0].message.content
    finally:
        last.stop()


def test_a_refused_turn_leaves_its_conversation_as_it_was(
    start_daemon: Start, start_gateway: Callable[..., GatewayProcess]
) -> None:
    daemon = start_daemon("--context-size", "4096", config="[tasks.default]\nmax_queue = 1\n")
    gateway = start_gateway(daemon.address)
    c = client_of(gateway)
    history = [{"role": "user", "content": "keep me"}]
    first = chat(c, history, prompt_cache_key="patient")
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    busy = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=1800, stream=True
    )
    next(iter(busy))
    try:
        with pytest.raises(openai.RateLimitError):
            chat(c, history, prompt_cache_key="patient")
    finally:
        busy.close()
    with daemon.client() as watcher:
        wait_until(lambda: not watcher.status().sessions.generating, "the cancel", WAIT_S)
    again = chat(c, history, prompt_cache_key="patient")
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
