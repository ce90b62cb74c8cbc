"""Command-line flags derived from the settings records (kvpool.client.flags): each setting declared once, in
daemon/config.py's Config or the gateway's GatewayConfig. Pure: no model, no daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.daemon.config import Config, load_config
from kvpool.daemon.main import parse_args
from kvpool.gateway.main import parse_args as gateway_args


def test_daemon_flags_override_the_config_keys_they_are_named_after() -> None:
    args = parse_args(
        ["--hot-slots", "3", "--cache-pool-size", "64MiB", "--rpc-servers", "127.0.0.1:5,127.0.0.1:6",
         "--deterministic", "--pool-kv-type", "q8_0", "--client-patience", "2.5"]
    )  # fmt: skip
    overrides = {name: getattr(args, name) for name in args.config_flags if getattr(args, name) is not None}
    assert overrides == {
        "hot_slots": 3,
        "cache_pool_size": "64MiB",  # sizes are parsed by the config, as in a TOML file
        "rpc_servers": ["127.0.0.1:5", "127.0.0.1:6"],
        "deterministic": True,
        "pool_kv_type": "q8_0",
        "client_patience": 2.5,
    }
    config = load_config(None, {**overrides, "deterministic": False})  # (not with rpc workers)
    assert (config.hot_slots, config.cache_pool_size, config.rpc_servers) == (
        3,
        64 << 20,
        ["127.0.0.1:5", "127.0.0.1:6"],
    )
    assert set(args.config_flags) <= set(Config.__struct_fields__)
    assert (
        "--no-deterministic" in " ".join(["--no-deterministic"])
        and not parse_args(["--no-deterministic"]).deterministic
    )


def test_a_flag_refuses_a_value_its_setting_does_not_take(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--cache-type-k", "q3_k"])
    assert exit_.value.code == 2 and "invalid choice: 'q3_k'" in capsys.readouterr().err


def test_a_list_flag_with_an_empty_item_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`--rpc-servers ,` meant no workers at all, without a word: the whole model ran here."""
    for text in (",", "127.0.0.1:50052,,127.0.0.1:50053", " , "):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--rpc-servers", text])
        assert exit_.value.code == 2 and "has an empty item" in capsys.readouterr().err
    assert parse_args(["--rpc-servers", ""]).rpc_servers == []  # (an empty text clears the file's list)


def test_gateway_flags_their_variables_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_GATEWAY_PORT", "9123")
    config = gateway_args(["--no-reuse", "--alias", "a", "--alias", "b", "--health-check", "/up", "--state-file", "x"])
    assert (config.port, config.reuse, config.aliases, config.health_path) == (9123, False, ("a", "b"), "/up")
    assert config.state_file == Path("x") and config.prefill_tool_results
    assert not gateway_args(["--no-tool-result-prefill"]).prefill_tool_results
    assert gateway_args(["--port", "81"]).port == 81  # a flag goes before its variable
    assert gateway_args(["--state-file", ""]).state_file == gateway_args([]).state_file  # empty: the default file


def test_cors_origins_are_origins() -> None:
    from kvpool.gateway.settings import GatewayConfigError

    assert gateway_args(["--cors-origins", "http://a.example, https://b.example:8443"]).cors_origins == (
        "http://a.example",
        "https://b.example:8443",
    )
    gateway_args(["--cors-origins", "*"]).check()
    with pytest.raises(GatewayConfigError, match="no path"):
        gateway_args(["--cors-origins", "http://a.example/app"]).check()
