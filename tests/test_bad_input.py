"""Bad input gets its error code and a sentence, and the daemon keeps serving afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.client.aio import AsyncClient
from kvpool.client.errors import BadRequest, ContextOverflow

from .daemon_process import DaemonProcess
from .raw import RawConnection


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[RawConnection]:
    conn = RawConnection(daemon.address)
    yield conn
    conn.close()


def assert_error(reply: p.AnyReply, code: p.ErrorCode, request_id: int | None = None) -> p.Error:
    assert isinstance(reply, p.Error), f"expected {code}, got {reply}"
    assert reply.code == code, reply.message
    assert len(reply.message) > 20 and reply.message.endswith("."), "the message should be a sentence"
    if request_id is not None:
        assert reply.id == request_id
    return reply


def assert_still_serving(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        result = s.complete("still there?", max_tokens=4, temperature=0.0)
        assert result.usage.completion_tokens == 4


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",
        b"",
        b"\x93\x01\x02\x03",
        msgspec.msgpack.encode({"id": 3}),
        msgspec.msgpack.encode("hello"),
        msgspec.msgpack.encode({"op": [], "id": 1}),
        msgspec.msgpack.encode({"op": {"x": 1}, "id": 2}),
    ],
    ids=["invalid-msgpack", "empty", "array", "no-op", "string", "op-list", "op-map"],
)
def test_malformed_frames(raw: RawConnection, daemon: DaemonProcess, frame: bytes) -> None:
    raw.send_frames(frame)
    assert_error(raw.recv(), p.ErrorCode.BAD_REQUEST)
    assert_still_serving(daemon)


def test_several_frames_in_one_message(raw: RawConnection, daemon: DaemonProcess) -> None:
    raw.send_frames(p.encode(p.Status(id=1)), b"extra")
    assert_error(raw.recv(), p.ErrorCode.BAD_REQUEST)
    assert_still_serving(daemon)


def test_unknown_op_is_named(raw: RawConnection, daemon: DaemonProcess) -> None:
    error = assert_error(raw.call({"op": "explode", "id": 5}), p.ErrorCode.UNKNOWN_OP, 5)
    assert "explode" in error.message and "generate" in error.message
    assert_still_serving(daemon)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"session": 123, "token": "x"}, "session"),
        ({"session": "s", "token": "x", "max_tokens": "many"}, "max_tokens"),
        ({"session": "s", "token": "x", "prompt_tokens": [-1]}, "prompt_tokens"),
        ({"session": "s", "token": "x", "surprise": 1}, "surprise"),
        ({"session": "s", "token": "x", "temperature": -1.0}, "temperature"),
        ({"session": "s", "token": "x", "top_p": 0.0}, "top_p"),
        ({"session": "s", "token": "x", "min_p": 1.5}, "min_p"),
        ({"session": "s", "token": "x", "max_tokens": -1}, "max_tokens"),
        ({"session": "s", "token": "x", "repeat_penalty": 0.0}, "repeat_penalty"),
        ({"session": "s", "token": "x", "seed": -5}, "seed"),
    ],
)
def test_wrong_types_and_out_of_range_values(
    raw: RawConnection, daemon: DaemonProcess, fields: dict, named: str
) -> None:
    error = assert_error(raw.call({"op": "generate", "id": 9, **fields}), p.ErrorCode.BAD_REQUEST, 9)
    assert named in error.message
    assert_still_serving(daemon)


def test_client_library_checks_sampler_values_before_sending(daemon: DaemonProcess) -> None:
    with daemon.client() as client, client.open_session() as s:
        with pytest.raises(BadRequest, match="temperature"):
            s.generate("x", temperature=-0.5)
        assert s.complete("x", max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        # A prompt of another type, or an integer past what the wire carries: refused here, never sent as
        # something else (a dict's keys as text parts, bytes as token ids).
        for prompt in ({"hello": 1}, b"abc", None, 5):
            with pytest.raises(BadRequest, match="prompt is text"):
                s.generate(prompt)  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="prompt is text"):
            client.open_session(system_prompt={"x": 1})  # type: ignore[arg-type]
        for call in (lambda: s.complete([2**64]), lambda: s.complete("x", after=2**64), lambda: s.history(2**64)):
            with pytest.raises(BadRequest, match="out of range"):
                call()
        with pytest.raises(BadRequest, match="out of range"):
            client.detokenize([2**64])
        assert s.complete("x", max_tokens=2, temperature=0.0).usage.completion_tokens == 2


def test_a_client_with_a_wrong_address_or_wait_is_refused_before_it_connects(daemon: DaemonProcess) -> None:
    """Not ipc:// or tcp://, or a wait that is not a positive number of seconds (NaN never ends): BadRequest with a
    sentence, from both clients, before a socket is made (none is left behind)."""
    for address, waits in (("foo", {}), ("foo://bar", {}), (daemon.address, {"timeout": float("nan")})):
        with pytest.raises(BadRequest, match=r"ipc://PATH|positive numbers of seconds"):
            Client(address, **waits)
        with pytest.raises(BadRequest, match=r"ipc://PATH|positive numbers of seconds"):
            asyncio.run(AsyncClient.connect(address, **waits))
    with Client(daemon.address) as client:  # (the daemon never saw them)
        assert client.status().counters.errors == {}


def test_a_request_too_large_for_one_message_is_refused_before_sending(daemon: DaemonProcess) -> None:
    # 2**20 four-byte characters pass the prompt's length limit (it counts characters) but encode to more than the
    # daemon's 4 MiB max_message_bytes: ZeroMQ would drop the frame and the connection, and no error could come
    # back. The client library knows the limit from the hello and refuses the request itself.
    with daemon.client(timeout=10) as client, client.open_session() as s:
        with pytest.raises(BadRequest, match="max_message_bytes") as refused:
            s.complete("\U0001f600" * (1 << 20), max_tokens=2)
        assert refused.value.detail["frame_bytes"] > refused.value.detail["max_message_bytes"] == 4 << 20
        assert s.complete("x", max_tokens=2, temperature=0.0).usage.completion_tokens == 2  # same connection


def test_unknown_and_foreign_sessions(raw: RawConnection, daemon: DaemonProcess) -> None:
    opened = raw.open()
    reply = raw.call(p.Generate(id=11, session="0123456789abcdef", token=opened.token, prompt="hi"))
    assert_error(reply, p.ErrorCode.UNKNOWN_SESSION, 11)
    reply = raw.call(p.Generate(id=12, session=opened.session, token="f" * 32, prompt="hi"))
    error = assert_error(reply, p.ErrorCode.NOT_OWNER, 12)
    assert opened.token not in error.message
    for message in (
        p.Cancel(id=13, session=opened.session, token="nope"),
        p.CloseSession(id=14, session=opened.session, token="nope"),
    ):
        assert_error(raw.call(message), p.ErrorCode.NOT_OWNER)
    # the owner still has its session
    raw.send(p.Generate(id=15, session=opened.session, token=opened.token, prompt="hi", max_tokens=3, temperature=0.0))
    _, final = raw.until_final(15)
    assert final.usage.completion_tokens == 3


def test_prompt_longer_than_the_context(raw: RawConnection, daemon: DaemonProcess) -> None:
    opened = raw.open()
    reply = raw.call(p.Generate(id=21, session=opened.session, token=opened.token, prompt="x" * 5000))
    error = assert_error(reply, p.ErrorCode.CONTEXT_OVERFLOW, 21)
    assert error.detail is not None and error.detail["prompt_tokens"] > error.detail["room"]
    assert_still_serving(daemon)


def test_a_full_session_says_it_is_full(daemon: DaemonProcess) -> None:
    """(An empty prompt on it was refused as "0 tokens but the session has room for 0 more".)"""
    with daemon.client() as client, client.open_session() as s:
        done = s.complete("x" * 2000, max_tokens=200, temperature=0.0)
        assert done.finish_reason == "length" and done.usage.context_tokens == 2048
        for prompt in ("", "more"):
            with pytest.raises(ContextOverflow, match="is full: it holds 2048 tokens"):
                s.complete(prompt, max_tokens=4)


def test_text_too_long_for_any_room_is_refused_before_it_is_tokenized(
    raw: RawConnection, daemon: DaemonProcess
) -> None:
    """Text of more bytes than the room in tokens times the vocabulary's longest token is refused as it comes:
    llama.cpp's tokenizer takes time that grows faster than the text on the test model's byte-level vocabulary
    (23 s for 300k characters), while every other request waits. 1 MB here would take minutes."""
    opened = raw.open()
    long = "a" * 1_000_000
    for request in (
        p.Generate(id=25, session=opened.session, token=opened.token, prompt=long),
        p.OpenSession(id=26, system_prompt=long),
        p.Tokenize(id=27, text=long * 4),
    ):
        error = assert_error(raw.call(request), p.ErrorCode.CONTEXT_OVERFLOW, request.id)
        assert error.detail is not None and error.detail["prompt_bytes"] > error.detail["room"], error
        assert "bytes" in error.message
    assert_still_serving(daemon)


def test_a_connection_that_floods_the_daemon_holds_nobody_else_up(raw: RawConnection, daemon: DaemonProcess) -> None:
    """Requests were handled in arrival order, all of them between two steps: a connection that sent many held
    every other connection's answers, and every running answer's next step, until its last was handled. Now
    connections take turns: another's request is answered while the flood is still being worked through."""
    flood = 600
    tokens = [i % 256 + 3 for i in range(2048)]  # (a context's worth of byte tokens: more is refused)
    error = assert_error(raw.call(p.Detokenize(id=1, tokens=tokens * 2)), p.ErrorCode.BAD_REQUEST, 1)
    assert "in pieces" in error.message
    for i in range(flood):
        raw.send(p.Tokenize(id=100 + i, text="ab c" * 1500))  # (never read until the end)
    with daemon.client() as other, other.open_session() as s:
        streamed = s.complete("meanwhile", max_tokens=8, temperature=0.0)
    answered = 0
    while True:
        try:
            raw.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        answered += 1
    assert streamed.usage.completion_tokens == 8
    assert answered < flood // 2, f"{answered} of the flood's {flood} were answered before the other connection's"
    raw.sock.setsockopt(zmq.RCVTIMEO, 60_000)
    for _ in range(flood - answered):  # the flood is answered too, in full
        assert isinstance(raw.recv(), p.TokensReply)


def test_a_request_id_in_flight_is_not_taken_again(raw: RawConnection, daemon: DaemonProcess) -> None:
    """Two generations with one id on one connection were both run: their chunks, which carry only the id, came
    interleaved, and no client could tell them apart."""
    first, second = raw.open(), raw.open()
    raw.send(p.Generate(id=7, session=first.session, token=first.token, prompt="one", max_tokens=400))
    raw.send(p.Generate(id=7, session=second.session, token=second.token, prompt="two", max_tokens=4))
    replies = [raw.recv()]
    while not isinstance(replies[-1], p.Final):  # the first one's chunks, its final, and the refusal among them
        replies.append(raw.recv())
        assert len(replies) < 1000
    (error,) = [r for r in replies if isinstance(r, p.Error)]
    assert error.code == p.ErrorCode.BAD_REQUEST and error.id == 7
    assert "already a generation in flight" in error.message
    assert sum(len(r.tokens) for r in replies if isinstance(r, p.Chunk)) == replies[-1].usage.completion_tokens
    assert_still_serving(daemon)


def test_busy_session_unknown_task_and_version(raw: RawConnection, daemon: DaemonProcess) -> None:
    opened = raw.open()
    raw.send(
        p.Generate(id=31, session=opened.session, token=opened.token, prompt="a", max_tokens=1500, temperature=0.0)
    )
    busy = raw.call(p.Generate(id=32, session=opened.session, token=opened.token, prompt="b"))
    assert_error(busy, p.ErrorCode.SESSION_BUSY, 32)
    assert_error(raw.call(p.OpenSession(id=33, task="nosuchtask")), p.ErrorCode.UNKNOWN_TASK, 33)
    assert_error(raw.call(p.Hello(id=34, version=999)), p.ErrorCode.VERSION_MISMATCH, 34)
    assert_still_serving(daemon)


def test_bad_system_prompts(raw: RawConnection, daemon: DaemonProcess) -> None:
    both = p.OpenSession(id=41, system_prompt="You are kind.", system_prompt_tokens=[1, 72])
    assert_error(raw.call(both), p.ErrorCode.BAD_REQUEST, 41)
    assert_error(raw.call(p.OpenSession(id=42, system_prompt_tokens=[1, 10**7])), p.ErrorCode.BAD_REQUEST, 42)
    too_long = assert_error(raw.call(p.OpenSession(id=43, system_prompt="x" * 5000)), p.ErrorCode.CONTEXT_OVERFLOW)
    assert too_long.detail is not None and too_long.detail["prompt_tokens"] >= too_long.detail["context_limit"]
    assert_error(raw.call({"op": "open", "id": 44, "system_prompt": 7}), p.ErrorCode.BAD_REQUEST, 44)
    with daemon.client() as client:
        assert client.sessions() == []  # nothing was opened by the refused requests
    assert_still_serving(daemon)
