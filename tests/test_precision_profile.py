"""Precision profiles' pure parts (no model): the store type a profile names and the id its records carry, the
choice of the layers to lower, and reading, finding and refusing profile files. The command that measures one and
a daemon that stores by it are in test_kv_profile_daemon.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.daemon.config import ConfigError, load_config
from kvpool.daemon.kv.codec.kv_types import StoreType, coding_named
from kvpool.daemon.kv.codec.precision_profile import (
    SHIPPED,
    SUFFIX,
    PrecisionProfile,
    ProfileError,
    beside,
    choose_lowered,
    find_profile,
    read_profile,
)
from kvpool.daemon.kv.codec.transcode import Target

PRINT = "0123456789abcdef0123456789abcdef"


def profile_file(path: Path, **fields: object) -> Path:
    body: dict[str, object] = {
        "kvpool_kv_profile": 1,
        "model": "m.gguf",
        "fingerprint": PRINT,
        "k": "q5_1",
        "v": "q4_0h",
        "k_layers": {"0": "q8_0", "2": "q8_0"},
    }
    body.update(fields)
    path.write_text(json.dumps(body))
    return path


def test_a_profiles_store_type_keeps_its_layers_and_its_id_says_so() -> None:
    base = StoreType.named("q5_1/q4_0h")
    profiled = base.with_k_layers({2: coding_named("q8_0"), 0: coding_named("q8_0")})
    assert profiled.k_layers == ((0, coding_named("q8_0")), (2, coding_named("q8_0")))
    assert profiled.name == "q5_1/q4_0h by layer" and base.name == "q5_1/q4_0h"
    assert profiled.id != base.id and StoreType.known(profiled.id)
    read = StoreType.of_id(profiled.id)  # a record names the halves and that layers differ, not which
    assert (read.k, read.v, read.by_layer, read.k_layers) == (base.k, base.v, True, ())
    assert StoreType.of_id(base.id) == base and StoreType.of_id(8) == StoreType.named("q8_0")  # old ids hold
    assert not StoreType.known(profiled.id << 1) and not StoreType.known(profiled.id & ~(1 << 20))  # no pair bit
    target = Target.of(profiled)
    assert target.for_layer(0, "k") == coding_named("q8_0") and target.for_layer(1, "k") == base.k
    assert target.for_layer(None, "v") == base.v


def test_row_codings_are_named_as_the_settings_name_them() -> None:
    assert coding_named("q4_0h").rotated and coding_named("q4_0h").kv_type.name == "q4_0"
    assert coding_named("f16").kv_type.name == "f16" and not coding_named("f16").rotated
    for bad in ("q3_k", "f16h", "", "q8_0/q4_0"):
        with pytest.raises(ValueError, match="no row coding"):
            coding_named(bad)


def test_the_layers_cheapest_per_byte_are_lowered_within_the_allowance() -> None:
    base = 1.0
    kld = {0: 1.50, 1: 1.05, 2: 1.10, 3: 0.99, 4: 1.30}
    saving = {0: 100, 1: 100, 2: 10, 3: 100, 4: 1000}
    # cost per byte: #3 none (it measured below the base), #4 0.0003, #1 0.0005, #2 0.01, #0 0.005
    assert choose_lowered(base, kld, saving, most_kld=1.36) == [3, 4, 1]
    # #4 no longer fits; the ones after it in the order still do
    assert choose_lowered(base, kld, saving, most_kld=1.2) == [3, 1, 2]
    assert choose_lowered(base, kld, saving, most_kld=0.5) == []
    assert choose_lowered(base, kld, {**saving, 3: 0}, most_kld=1.36) == [4, 1]  # nothing saved: not lowered


def test_a_profile_file_is_read_and_what_is_wrong_with_one_is_said(tmp_path: Path) -> None:
    good = read_profile(profile_file(tmp_path / "p.json"))
    assert good.store_type().name == "q5_1/q4_0h by layer" and good.k_layers == {0: "q8_0", 2: "q8_0"}
    assert "K layers of their own: #0 q8_0, #2 q8_0" in good.describe()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=f"{bad} is no precision profile kvpool can read"):
        read_profile(bad)
    for fields, words in (
        ({"k": "q3_k"}, "no row coding"),
        ({"kvpool_kv_profile": 2, "newer": True}, "of format 2; this kvpool reads 1"),  # not its new field
        ({"extra": 1}, "unknown field"),
        ({"k_layers": {"x": "q8_0"}}, "no precision profile"),
    ):
        with pytest.raises(ProfileError, match=words):
            read_profile(profile_file(tmp_path / "p.json", **fields))
    with pytest.raises(ProfileError, match="does not exist"):
        read_profile(tmp_path / "none.json")


def test_the_profile_is_found_beside_the_model_and_refused_for_another(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(ProfileError, match=r"there is none for m.gguf .*kvpool-kv-profile --model"):
        find_profile("", model, PRINT, 4)
    profile_file(beside(model))
    assert beside(model).name == "m.gguf" + SUFFIX
    assert find_profile("", model, PRINT, 4).k_layers == {0: "q8_0", 2: "q8_0"}
    with pytest.raises(ProfileError, match=r"measured for another model \(m.gguf, fingerprint 0123.*fingerprint ffff"):
        find_profile("", model, "f" * 32, 4)
    with pytest.raises(ProfileError, match=r"names K layers \[2\], and the model has 2"):
        find_profile("", model, PRINT, 2)
    elsewhere = profile_file(tmp_path / "other.json", k_layers={})
    assert find_profile(str(elsewhere), model, PRINT, 4).k_layers == {}  # kv_profile wins over the file beside
    with pytest.raises(ProfileError, match=r"kv_profile = '/nowhere\.json': the file does not exist"):
        find_profile("/nowhere.json", model, PRINT, 4)


def test_the_shipped_profiles_are_profiles_for_the_models_they_name() -> None:
    shipped = sorted(SHIPPED.glob("*" + SUFFIX))
    assert shipped, "kvpool ships the default model's profile"
    for path in shipped:
        profile: PrecisionProfile = read_profile(path)
        assert profile.measured is not None and len(profile.fingerprint) == 32
        m = profile.measured
        assert m.vs_f16 > 1.0 and m.kld > 0 and m.floor_kld > 0 and m.layer_kld.keys() == m.layer_saving.keys()


def test_kv_profile_goes_only_with_a_tier_that_stores_by_it() -> None:
    with pytest.raises(ConfigError, match=r"kv_profile = 'p\.json' is set, but no tier stores by it"):
        load_config(overrides={"kv_profile": "p.json"})
    assert load_config(overrides={"kv_profile": "p.json", "spill_kv_type": "profile"}).kv_profile == "p.json"
    assert load_config(overrides={"pool_kv_type": "profile"}).pool_kv_type == "profile"
    with pytest.raises(ConfigError, match="pool_kv_type"):
        load_config(overrides={"pool_kv_type": "by-layer"})
    with pytest.raises(ConfigError, match="goes with the f16 hot KV the profile was measured on"):
        load_config(overrides={"pool_kv_type": "profile", "cache_type_k": "q8_0"})
