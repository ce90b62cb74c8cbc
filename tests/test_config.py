"""The configuration: defaults, files, flags and KVPOOL_* variables, and errors in words. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.daemon.config import Config, ConfigError, load_config, unknown_environment

ROOT = Path(__file__).resolve().parent.parent


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
        ("draft_tokens = 4\ndraft_min_tokens = 6", "draft_min_tokens = 6 is more than draft_tokens = 4"),
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
        ({"http": "0.0.0.0:80"}, {}, "it must be a loopback address and a port from 1 to 65535, e.g. 127.0.0.1:9101"),
        # (a port past 65535 passed, and the daemon died of the listener's OverflowError under its running threads)
        ({"http": "127.0.0.1:99999"}, {}, "`http` = '127.0.0.1:99999' is not allowed: it must be a loopback address"),
        ({"http": "127.0.0.1:0"}, {}, "`http` = '127.0.0.1:0' is not allowed"),
        # A size is blamed on where it was written: a variable, a flag (the file's name was given for both).
        ({}, {"KVPOOL_CACHE_POOL_SIZE": "banana"}, "KVPOOL_CACHE_POOL_SIZE: `cache_pool_size`: 'banana' is not a size"),
        ({"cache_pool_size": "banana"}, {}, "--cache-pool-size: `cache_pool_size`: 'banana' is not a size"),
        ({"cache_pool_size": "1.5"}, {}, "'1.5' is not a whole number of bytes"),  # (it was read as 1 byte)
        # A list's item: its value, its flag and the words for it (it said "defaults: ... = None" and a regex).
        (
            {"rpc_servers": ["127.0.0.1:0"]},
            {},
            "--rpc-servers: `rpc_servers[0]` = '127.0.0.1:0' is not allowed: it must be",
        ),
        ({"deterministic": True, "cpu_repack": "on"}, {}, "--cpu-repack: deterministic = true does not go with"),
        # Settings of the rpc split without rpc workers were ignored without a word.
        ({"rpc_layers": 3}, {}, "rpc_layers is set but rpc_servers is empty"),
        ({"tensor_split": [1.0]}, {}, "tensor_split is set but rpc_servers is empty"),
        # hot_slots and prefix_slots each within bounds, together past llama.cpp's 256 sequences: it could not start.
        ({"hot_slots": 256}, {}, "hot_slots = 256 and prefix_slots = 2 take 259 of llama.cpp's sequences"),
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


def test_a_kvpool_variable_that_names_no_setting_is_found() -> None:
    environ = {"KVPOOL_HOT_SLOT": "0", "KVPOOL_HOT_SLOTS": "2", "KVPOOL_ADDRESS": "ipc:///x", "KVPOOL_TASKS": "x"}
    environ |= {"KVPOOL_GATEWAY_PORT": "1", "KVPOOL_CURVE_SERVER_KEY": "k", "HOME": "/root"}
    assert unknown_environment(environ) == ["KVPOOL_HOT_SLOT", "KVPOOL_TASKS"]  # (said at start, not dropped silently)


def test_flags_override_the_file_and_are_named_in_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("hot_slots = 8\ncontext_size = 1024\n")
    config = load_config(path, {"hot_slots": 2, "context_size": None})
    assert (config.hot_slots, config.context_size) == (2, 1024)
    with pytest.raises(ConfigError, match="--max-sessions"):
        load_config(path, {"max_sessions": 0})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    utf16 = tmp_path / "utf16.toml"
    utf16.write_text("hot_slots = 2\n", encoding="utf-16")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):  # (a UnicodeDecodeError's traceback)
        load_config(utf16)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)  # a directory


def test_config_reference_documents_every_key_and_flag() -> None:
    from kvpool.daemon.config import TaskProfile
    from kvpool.daemon.main import parse_args

    reference = (ROOT / "docs" / "config.md").read_text()
    for name in (*Config.__struct_fields__, *TaskProfile.__struct_fields__):
        if name != "tasks":
            assert f"`{name}`" in reference, f"docs/config.md does not document `{name}`"
    flagged = parse_args([]).config_flags
    assert len(flagged) >= 30  # (the settings with a Flag in daemon/config.py)
    for key in flagged:
        assert f"`--{key.replace('_', '-')}`" in reference, f"docs/config.md does not document --{key}"


def test_example_configs_load() -> None:
    for path in (ROOT / "configs").glob("*.toml"):
        config = load_config(path)
        assert "default" in config.tasks, path
    edge = load_config(ROOT / "configs" / "edge-2gb.toml")
    assert edge.cache_pool_size == 192 << 20 and edge.tasks["vision"].best_effort


def test_a_bad_value_set_by_both_a_flag_and_a_variable_is_blamed_on_the_flag() -> None:
    # The flag's value is the one kept (and shown): the sentence named the variable, which said 2.
    with pytest.raises(ConfigError, match=r"^--hot-slots: `hot_slots` = 0 is not allowed"):
        load_config(overrides={"hot_slots": 0}, environ={"KVPOOL_HOT_SLOTS": "2"})
