"""The wire protocol: messages round-trip, bad frames are classified, every error code has its exception;
and telling a request lost to a daemon restart. Pure: no model, no daemon."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpool import protocol as p
from kvpool.client.errors import KvpoolError, NotOwner, error_from_code

ROOT = Path(__file__).resolve().parent.parent


def test_every_request_round_trips() -> None:
    messages = [
        p.Hello(id=1, version=1),
        p.Status(id=2),
        p.ListSessions(id=3),
        p.OpenSession(id=4, task="voice"),
        p.CloseSession(id=5, session="s", token="t"),
        p.Cancel(id=6, session="s", token="t"),
        p.Generate(id=7, session="s", token="t", prompt="hi", stop=["\n"], seed=3),
    ]
    for message in messages:
        assert p.decode_request(p.encode(message)) == message


def test_decode_errors_are_classified() -> None:
    with pytest.raises(p.RequestDecodeError) as bad:
        p.decode_request(b"\xc1")
    assert bad.value.code == p.ErrorCode.BAD_REQUEST
    with pytest.raises(p.RequestDecodeError) as unknown:
        p.decode_request(msgspec.msgpack.encode({"op": "fly", "id": 8}))
    assert unknown.value.code == p.ErrorCode.UNKNOWN_OP and unknown.value.request_id == 8
    with pytest.raises(p.RequestDecodeError) as wrong:
        p.decode_request(msgspec.msgpack.encode({"op": "generate", "id": 9, "session": "s", "token": "t", "top_k": -1}))
    assert wrong.value.code == p.ErrorCode.BAD_REQUEST and "top_k" in wrong.value.message
    with pytest.raises(p.RequestDecodeError, match="nests maps or arrays too deeply"):  # (a RecursionError)
        p.decode_request(b"\x91" * 100_000 + b"\xc0")


def test_a_bool_request_id_is_not_echoed() -> None:
    # found by the fuzzer: True is an int to Python, but a reply carrying it could not be decoded
    with pytest.raises(p.RequestDecodeError) as bad:
        p.decode_request(msgspec.msgpack.encode({"op": "open", "id": True}))
    assert bad.value.request_id == 0
    p.decode_reply(p.encode(p.Error(id=bad.value.request_id, code=bad.value.code, message=bad.value.message)))


def test_every_error_code_has_an_exception_class() -> None:
    for code in p.ErrorCode:
        exc = error_from_code(code, "why.")
        assert exc.code == code and type(exc) is not KvpoolError
    assert isinstance(error_from_code("NOT_OWNER", "x"), NotOwner)
    assert type(error_from_code("FUTURE_CODE", "x")) is KvpoolError


def test_an_error_code_newer_than_this_client_still_ends_its_request() -> None:
    # A newer daemon's code (SPILL_UNAVAILABLE was one) failed the reply's validation: the client dropped the frame
    # and its request waited out its timeout, a cut generation's detail lost with it.
    from kvpool.client.results import raise_if_error

    frame = msgspec.msgpack.encode(
        {
            "op": "error",
            "id": 7,
            "instance": "d1",
            "code": "FUTURE_CODE",
            "message": "Something a newer daemon says.",
            "detail": {"completion_tokens": 3, "context_tokens": 40},
        }
    )
    reply = p.decode_reply(frame)
    assert isinstance(reply, p.Error) and (reply.id, reply.instance, reply.code) == (7, "d1", "FUTURE_CODE")
    with pytest.raises(KvpoolError) as raised:
        raise_if_error(reply)
    assert raised.value.code == "FUTURE_CODE" and raised.value.message == "Something a newer daemon says."
    assert raised.value.cut  # what the session kept still reads as a cut answer
    assert p._ErrorOfAnyCode.__struct_fields__ == p.Error.__struct_fields__  # (a field added to one goes in both)
    # A known code still decodes as its member, and a frame that is no reply at all is still refused.
    known = p.decode_reply(p.encode(p.Error(id=1, code=p.ErrorCode.POOL_FULL, message="m")))
    assert isinstance(known, p.Error) and known.code is p.ErrorCode.POOL_FULL
    with pytest.raises(msgspec.ValidationError, match="code"):
        p.decode_reply(msgspec.msgpack.encode({"op": "error", "id": 1, "code": 5, "message": "m"}))
    with pytest.raises(msgspec.ValidationError, match="finish_reason"):
        p.decode_reply(msgspec.msgpack.encode({"op": "final", "id": 1, "finish_reason": "future"}))


def test_a_request_is_lost_to_a_restart_only_if_the_old_daemon_heard_it() -> None:
    from kvpool import protocol as p
    from kvpool.client.restarts import RestartWatch

    watch = RestartWatch()
    watch.heard(p.HelloReply(version=1, daemon_version="x", model="m", instance="old"), now=1.0)
    watch.heard(p.Chunk(text="a", tokens=[1], instance="old"), now=2.5)  # the old daemon answered request 2
    # a new daemon answers first with a chunk (before any pong): that chunk is the new daemon's, by its instance
    watch.heard(p.Chunk(text="b", tokens=[2], instance="new"), now=3.0)
    assert watch.restarted_at == 3.0 and watch.heard_before_restart == 2.5
    assert watch.lost(sent=2.0)  # sent before the old daemon's last word: it went down with it
    assert not watch.lost(sent=2.7)  # sent after: the new daemon got it
    watch.heard(p.Pong(instance="new"), now=4.0)
    assert watch.restarted_at == 3.0  # the same daemon again: no new restart


def test_every_sampler_setting_is_a_generate_field_with_the_samplers_default() -> None:
    """The daemon copies a request's sampler fields by name (engine/requests.py): a setting missing from Generate,
    or with another default, would be silently dropped or changed."""
    import dataclasses

    from kvpool.daemon.llama.model.sampling import SamplingParams

    generate = {f.name: f.default for f in msgspec.structs.fields(p.Generate)}
    for f in dataclasses.fields(SamplingParams):
        assert f.name in generate, f"SamplingParams.{f.name} has no Generate field"
        if f.name not in ("logit_bias", "grammar"):  # (a dict on the wire; a grammar from grammar or json_schema)
            assert generate[f.name] == f.default, f"{f.name}: Generate's default differs from the sampler's"
