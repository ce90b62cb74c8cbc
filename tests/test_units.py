"""Unit tests of the pure parts: protocol, config, scheduler, streamed text. No model, no daemon."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool import protocol as p
from kvpool.client.errors import KvpoolError, NotOwner, error_from_code
from kvpool.daemon.config import Config, ConfigError, load_config
from kvpool.daemon.engine.stream_text import StreamText

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- protocol


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


# ---------------------------------------------------------------- config


def test_shipped_default_config_equals_the_built_in_defaults() -> None:
    shipped = load_config(ROOT / "configs" / "default.toml")
    built_in = Config()
    for name in Config.__struct_fields__:
        if name != "tasks":
            assert getattr(shipped, name) == getattr(built_in, name), name
    assert set(shipped.tasks) >= {"default", "voice", "vision"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hot_slots = 0", "`hot_slots` = 0"),
        ("hot_slotz = 2", "unknown key `hot_slotz`"),
        ("context_size = 'big'", "`context_size` = 'big'"),
        ("[tasks.default]\n[tasks.voice]\nmax_sessions = -1", "`tasks.voice.max_sessions` = -1"),
        ("[tasks.default]\n[tasks.voice]\nmax_sesions = 1", "unknown key `max_sesions` in [tasks.voice]"),
        ("[tasks.voice]", "`default` profile"),
        ("[tasks.default]\n[tasks.'bad name']", "task name 'bad name'"),
        ("hot_slots = ", "not valid TOML"),
        ("log_level = 'loud'", "`log_level` = 'loud'"),
    ],
)
def test_bad_config_names_key_and_value(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        load_config(path)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "environ", "sentence"),
    [
        ({"pool_name": "kvh-1"}, {}, "--pool-name: `pool_name` = 'kvh-1' is not allowed: it must start with '/'"),
        ({"http": "0.0.0.0:80"}, {}, "it must be a loopback address and port, e.g. 127.0.0.1:9101"),
        (
            {},
            {"KVPOOL_CHECKPOINT": "never"},
            "KVPOOL_CHECKPOINT: `checkpoint` = 'never' is not allowed: "
            'it must be one of "after_generate", "on_evict"',
        ),
        ({"hot_slots": 0}, {}, "`hot_slots` = 0 is not allowed: it must be a whole number of at least 1."),
        ({"context_size": "big"}, {}, "it must be a whole number, not text."),
    ],
)
def test_config_errors_say_what_is_expected_in_words(
    overrides: dict[str, object], environ: dict[str, str], sentence: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, environ)
    assert sentence in str(err.value)
    assert "Expected" not in str(err.value) and "regex" not in str(err.value)


def test_flags_override_the_file_and_are_named_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("hot_slots = 8\ncontext_size = 1024\n")
    config = load_config(path, {"hot_slots": 2, "context_size": None})
    assert (config.hot_slots, config.context_size) == (2, 1024)
    with pytest.raises(ConfigError, match="--max-sessions"):
        load_config(path, {"max_sessions": 0})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


# ---------------------------------------------------------------- streamed text


def test_multibyte_characters_split_across_tokens() -> None:
    text = StreamText([])
    euro = "€".encode()
    assert [text.feed(euro[:1]), text.feed(euro[1:2]), text.feed(euro[2:] + b"!")] == ["", "", "€!"]


def test_stop_string_is_held_back_and_cut() -> None:
    text = StreamText(["STOP"])
    assert text.feed(b"abc ST") == "abc "
    assert text.feed(b"O") == ""
    assert text.feed(b"Px") == ""
    assert text.stopped and text.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    text = StreamText(["STOP"])
    assert text.feed(b"ST") == ""
    assert text.feed(b"AY") == "STAY"
    assert text.feed(b"S") == ""
    assert text.flush() == "S"


@given(st.text(max_size=60), st.lists(st.text(min_size=1, max_size=4), max_size=3), st.data())
def test_streamed_text_equals_text_up_to_first_stop(body: str, stops: list[str], data: st.DataObject) -> None:
    raw = body.encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=10)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    text = StreamText(stops)
    out = "".join(text.feed(piece) for piece in pieces) + text.flush()
    first = min((i for i in (body.find(s) for s in stops) if i >= 0), default=-1)
    assert out == (body[:first] if first >= 0 else body)
    assert text.stopped == (first >= 0)


def test_config_reference_documents_every_key_and_flag() -> None:
    from kvpool.daemon.config import TaskProfile
    from kvpool.daemon.main import OVERRIDES

    reference = (ROOT / "docs" / "config.md").read_text()
    for name in (*Config.__struct_fields__, *TaskProfile.__struct_fields__):
        if name != "tasks":
            assert f"`{name}`" in reference, f"docs/config.md does not document `{name}`"
    for key in OVERRIDES:
        assert f"`--{key.replace('_', '-')}`" in reference, f"docs/config.md does not document --{key}"


def test_example_configs_load() -> None:
    for path in (ROOT / "configs").glob("*.toml"):
        config = load_config(path)
        assert "default" in config.tasks, path
    edge = load_config(ROOT / "configs" / "edge-2gb.toml")
    assert edge.cache_pool_size == 192 << 20 and edge.tasks["vision"].best_effort


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
