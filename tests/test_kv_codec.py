"""KV compression's pure parts and its contract with llama.cpp: the sequence-state reader on real states of the
tiny model, the block kernels against llama.cpp's own quantized KV, the settings a model can hold, and the
identity a spill file carries. The daemon-level behaviour is in test_kv_compression.py."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.daemon.kv.codec.kv_types import KV_TYPES, ROTATED_FLAG, STORE_TYPES, StoreType
from kvpool.daemon.kv.codec.rotation import block_size, rotate, unrotate
from kvpool.daemon.kv.codec.state_format import MAGIC, StateFormatError, parse, rewrite
from kvpool.daemon.kv.codec.tier_codec import TierCodec
from kvpool.daemon.kv.codec.transcode import Target, decode_rows, encode_rows, transcode
from kvpool.daemon.kv.pool.checksum import checksum
from kvpool.daemon.kv.spill_dir import SnapshotCorrupt, SpillDir
from kvpool.daemon.llama.kv_settings import KvSettings, KvSettingsError, resolve_kv_settings
from kvpool.daemon.llama.memory_plan import model_shape
from kvpool.daemon.llama.model import Model

from .tinymodel import N_LAYER, build_tiny_model

Q8, Q4, F16, F32 = KV_TYPES["q8_0"], KV_TYPES["q4_0"], KV_TYPES["f16"], KV_TYPES["f32"]
PROMPT = "the quick brown fox jumps over the lazy dog, " * 3


@pytest.fixture(scope="module")
def wide_heads_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 32-value heads: a quantized KV cache fits it."""
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "tiny-wide.gguf", heads=(2, 1))


def load(path: Path, k: str = "f16", v: str = "f16", flash_attn: str = "auto") -> Model:
    shape = model_shape(path)
    kv, _ = resolve_kv_settings(k, v, flash_attn, shape.head_k, shape.head_v, environ={})
    return Model(path, context_size=512, hot_slots=1, batch_size=256, threads=2, kv=kv)


def prefill(model: Model, text: str = PROMPT) -> list[int]:
    tokens = model.tokenize(text, add_bos=True)
    model.batch.clear()
    model.batch.add(0, tokens, 0, outputs=True)
    assert model.decode() == 0
    return tokens


def saved(model: Model) -> bytes:
    size = model.state_size(0)
    buffer = (ctypes.c_uint8 * size)()
    assert model.save_state(0, buffer) == size
    return bytes(buffer)


def logits(model: Model) -> np.ndarray:
    """The one row of logits the last decode (of one sequence, last token only) returned."""
    return model.output_logits(1)[0].copy()


def loads(model: Model, state: bytes) -> bool:
    return model.load_state(0, (ctypes.c_uint8 * len(state)).from_buffer_copy(state))


@pytest.fixture(scope="module")
def tiny_states(tiny_model: Path) -> Iterator[dict[str, tuple[bytes, int]]]:
    """A state of the tiny model with flash attention on and off, and its token count."""
    states = {}
    for fa in ("auto", "off"):
        model = load(tiny_model, flash_attn=fa)
        try:
            n = len(prefill(model))
            states[fa] = (saved(model), n)
        finally:
            model.close()
    yield states


# ---------------------------------------------------------------- the state format


def test_the_reader_knows_llama_cpps_state_byte_for_byte(tiny_states: dict[str, tuple[bytes, int]]) -> None:
    # What the pinned llama.cpp writes: if a new version changes the format, this is the test that says so.
    state, n = tiny_states["auto"]
    parsed = parse(state)
    assert struct.unpack_from("<I", state)[0] == MAGIC and parsed.seq_id == 0 and parsed.cells == n
    assert [x.kind for x in parsed.layers] == ["k"] * N_LAYER + ["v"] * N_LAYER
    assert all(x.kv_type == F16 and x.n_rows == n and x.n_cols == 32 for x in parsed.layers)
    assert not parsed.transposed_v and parsed.layers[-1].end == len(state)
    assert rewrite(parsed, {}) == state
    transposed, _ = tiny_states["off"]
    parsed_off = parse(transposed)
    assert parsed_off.transposed_v and [x.kind for x in parsed_off.layers] == ["k"] * N_LAYER
    assert rewrite(parsed_off, {}) == transposed


def test_bytes_the_reader_does_not_know_are_refused_not_guessed(tiny_states: dict[str, tuple[bytes, int]]) -> None:
    state, _ = tiny_states["auto"]
    for cut in (0, 3, 8, 12, 40, len(state) // 2, len(state) - 1):
        with pytest.raises(StateFormatError):
            parse(state[:cut])
    with pytest.raises(StateFormatError, match="magic"):
        parse(b"\0" * 4 + state[4:])
    with pytest.raises(StateFormatError):
        parse(state + b"\0\0\0\0")  # trailing bytes are not another cache block
    first_k = parse(state).layers[0].offset
    unknown = bytearray(state)
    struct.pack_into("<i", unknown, first_k, 99)
    with pytest.raises(StateFormatError, match="ggml type 99"):
        parse(bytes(unknown))
    two_owners = bytearray(state)
    struct.pack_into("<I", two_owners, 20, 2)  # the first cell's n_seq_id: a whole-context state, not a sequence's
    with pytest.raises(StateFormatError, match="cell records"):
        parse(bytes(two_owners))


def test_compressed_states_load_back_at_the_hot_types(tiny_model: Path) -> None:
    model = load(tiny_model)
    try:
        n = len(prefill(model))
        state = saved(model)
        codec = TierCodec(model.kv, "q8_0", "always", "q4_0")
        for name, ratio, bound in (
            ("q8_0", 1.8, 0.01),
            ("q4_0", 3.0, 0.15),
            ("q4_0h", 3.0, 0.15),
            ("q8_0/q4_0h", 2.3, 0.15),
        ):
            to = StoreType.named(name)
            small = codec.compress(state, to)
            assert small is not None and len(state) / len(small) > ratio
            assert parse(small).types("k") == {to.k.name} and parse(small).types("v") == {to.v.name}
            assert not loads(model, small)  # llama.cpp refuses types its context does not have, rotated ones too
            back = codec.to_hot(small)
            assert len(back) == len(state) and parse(back).types("k") == {"f16"}
            assert loads(model, back) and model.highest_position(0) == n - 1
            original, restored = first_k_values(state), first_k_values(back)
            scale = np.abs(original).max()
            assert np.abs(restored - original).max() <= scale * bound
    finally:
        model.close()


def first_k_values(state: bytes) -> np.ndarray:
    layer = parse(state).layers[0]
    rows = np.frombuffer(state, np.uint8, layer.n_rows * layer.row_bytes, layer.data_offset)
    return decode_rows(rows.reshape(layer.n_rows, layer.row_bytes), layer.kv_type)


def test_transposed_v_is_kept_and_a_state_of_the_other_layout_is_refused(tiny_model: Path) -> None:
    model = load(tiny_model, flash_attn="off")
    try:
        prefill(model)
        state = saved(model)
        codec = TierCodec(model.kv, "q8_0", "always", "same")
        small = codec.compress(state, StoreType.named("q8_0"))
        assert small is not None and parse(small).types("k") == {"q8_0"} and parse(small).transposed_v
        assert loads(model, codec.to_hot(small))
        with_fa = TierCodec(load_settings(tiny_model, "auto"), "q8_0", "always", "same")
        with pytest.raises(StateFormatError, match="flash attention on"):
            with_fa.to_hot(small)
    finally:
        model.close()


def load_settings(path: Path, flash_attn: str) -> KvSettings:
    shape = model_shape(path)
    return resolve_kv_settings("f16", "f16", flash_attn, shape.head_k, shape.head_v, environ={})[0]


def test_numpy_blocks_match_llama_cpps_quantized_kv(wide_heads_model: Path) -> None:
    """The reference is llama.cpp itself: a context that keeps its KV at q8_0 (or q4_0). Its own quantized rows
    read and re-quantized by the codec come out byte for byte; and f16 rows quantized by the codec, loaded into
    that context, give the logits llama.cpp's own quantized KV gives."""
    for name in ("q8_0", "q4_0"):
        t = KV_TYPES[name]
        f16_model, quant_model = load(wide_heads_model), load(wide_heads_model, name, name)
        try:
            assert not quant_model.kv.rotate_k  # 32-value heads: llama.cpp rotates only multiples of 64
            prefill(f16_model), prefill(quant_model)
            native = saved(quant_model)
            assert parse(native).types("k") == {name}
            assert transcode(transcode(native, Target(F32, F32)), Target(t, t)) == native
            ours = transcode(saved(f16_model), Target(t, t))
            assert len(ours) == len(native)
            assert loads(quant_model, ours)
            # Feed one more token on the loaded state and on a freshly computed one: same next-token ranking.
            after_ours = step(quant_model)
            quant_model.forget_sequence(0)
            assert loads(quant_model, native)
            after_native = step(quant_model)
            assert np.argmax(after_ours) == np.argmax(after_native)
            assert np.abs(after_ours - after_native).max() < 0.05 * np.abs(after_native).max()
        finally:
            f16_model.close()
            quant_model.close()


def step(model: Model) -> np.ndarray:
    pos = model.highest_position(0) + 1
    model.batch.clear()
    model.batch.add(0, [ord("x") + 3], pos, outputs=True)
    assert model.decode() == 0
    return logits(model)


# ---------------------------------------------------------------- settings and identity


def test_kv_settings_refuse_what_llama_cpp_would_and_name_rotation() -> None:
    with pytest.raises(KvSettingsError, match="needs flash attention"):
        resolve_kv_settings("f16", "q8_0", "off", 256, 256, environ={})
    with pytest.raises(KvSettingsError, match="16 values"):
        resolve_kv_settings("q8_0", "f16", "auto", 16, 16, environ={})
    settings, why = resolve_kv_settings("q8_0", "q4_0", "auto", 256, 256, environ={})
    assert settings.flash_attn and settings.rotate_k and settings.rotate_v and "required by cache_type_v" in why
    off, _ = resolve_kv_settings("q8_0", "q4_0", "auto", 256, 256, environ={"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert not off.rotate_k and off.layout != settings.layout
    assert not resolve_kv_settings("q8_0", "f16", "on", 32, 32, environ={})[0].rotate_k  # not a multiple of 64
    assert not resolve_kv_settings("f16", "f16", "off", 256, 256, environ={})[0].flash_attn
    layouts = {
        resolve_kv_settings(k, v, fa, 256, 256, environ={})[0].layout
        for k in KV_TYPES
        for v in KV_TYPES
        for fa in ("on", "off")
        if fa == "on" or not KV_TYPES[v].quantized
    }
    assert all(len(x) <= 64 for x in layouts)  # the pool header's field
    assert len(layouts) == len(KV_TYPES) * len(KV_TYPES) + len(KV_TYPES) * 3  # every setting has its own


def test_a_store_type_no_smaller_than_the_hot_one_stores_the_hot_one() -> None:
    hot_q4, _ = resolve_kv_settings("q4_0", "q4_0", "auto", 256, 256, environ={})
    codec = TierCodec(hot_q4, "q8_0", "when_full", "q4_0")
    assert codec.pool_type is None and codec.spill_type is None and not codec.compress_when_full
    assert set(STORE_TYPES) == {"same", "q8_0", "q8_0/q4_0h", "q5_1/q4_0h", "q4_0h", "q4_0"}
    for name in STORE_TYPES[1:]:
        assert StoreType.named(name).name == name  # every setting is a store type the codec reads back


def test_a_spill_file_of_another_kv_layout_is_refused(tmp_path: Path) -> None:
    payload = memoryview(bytes(range(64)) * 4)
    writer = SpillDir(tmp_path, 1 << 20, "m" * 32, "k=f16,v=f16,fa=1,rot=00,swa_full=0")
    digest = checksum(payload)
    writer.write("s1", 1, payload, 256 - 8, 2, 2, digest)
    assert writer.read("s1", 1, digest) == payload.tobytes()
    other = SpillDir(tmp_path, 1 << 20, "m" * 32, "k=f16,v=f16,fa=0,rot=00,swa_full=0")
    with pytest.raises(SnapshotCorrupt, match=r"fa=1.*fa=0"):
        other.read("s1", 1, digest)
    foreign = SpillDir(tmp_path, 1 << 20, "n" * 32, "k=f16,v=f16,fa=1,rot=00,swa_full=0")
    with pytest.raises(SnapshotCorrupt, match="another model"):
        foreign.read("s1", 1, digest)
    assert os.path.exists(tmp_path / "s1.1.snap")  # refused, not deleted: the right daemon can still read it


def test_the_memory_plan_sizes_the_hot_kv_at_its_types(tiny_model: Path) -> None:
    from kvpool.daemon.config import load_config
    from kvpool.daemon.llama.memory_plan import plan_memory

    f16 = plan_memory(tiny_model, load_config(None, {}))
    q8 = plan_memory(tiny_model, load_config(None, {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}))
    mixed = plan_memory(tiny_model, load_config(None, {"cache_type_k": "q8_0", "cache_type_v": "q4_0"}))
    assert q8.hot_kv * 64 == f16.hot_kv * 34  # a row of 32 values: 64 bytes at f16, one 34-byte q8_0 block
    assert mixed.hot_kv * 64 == f16.hot_kv * (34 + 18) // 2
    assert q8.total < f16.total and q8.weights == f16.weights


def test_store_types_keep_the_ids_old_records_hold_and_name_both_halves() -> None:
    assert (StoreType.named("q8_0").id, StoreType.named("q4_0").id) == (Q8.ggml_id, Q4.ggml_id)  # as records said
    for name in ("q8_0", "q4_0h", "q5_0h/q4_0h", "q8_0/q4_0", "mxfp4h", "q4_1/q5_1h"):
        t = StoreType.named(name)
        assert t.name == name and StoreType.of_id(t.id) == t and StoreType.known(t.id)
    assert StoreType.named("q4_0h/q4_0h").name == "q4_0h"
    assert StoreType.named("q8_0/q4_0").bytes_per_element() == Q8.bytes_per_element() + Q4.bytes_per_element()
    for bad in ("q3_k", "f16", "q4_0/q4_0/q4_0", "q4_0x", ""):
        with pytest.raises(ValueError, match="no store type"):
            StoreType.named(bad)
    assert not StoreType.known(99) and not StoreType.known((1 << 20) | 99 << 10 | 2)
    assert not StoreType.known((1 << 25) | StoreType.named("q4_0h").id)  # (bits above the pair's: a corrupt id)


def test_rotation_is_undone_and_spreads_an_outlier_over_its_block() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((48, 256)).astype(np.float32)
    rows[:, 5] *= 25.0  # one channel far larger than the rest, as K caches have
    turned = rotate(rows)
    assert block_size(256) == 256 and block_size(96) == 32 and block_size(640) == 128
    assert np.allclose(np.linalg.norm(turned, axis=1), np.linalg.norm(rows, axis=1), rtol=1e-5)
    assert np.abs(unrotate(turned) - rows).max() < 1e-4
    assert np.abs(turned).max() < 0.5 * np.abs(rows).max()  # the outlier shared out
    plain = decode_rows(encode_rows(rows, Q4), Q4)
    via_rotation = unrotate(decode_rows(encode_rows(turned, Q4), Q4))
    assert np.square(via_rotation - rows).mean() < 0.5 * np.square(plain - rows).mean()


def test_a_rotated_layer_says_so_in_its_type_field(tiny_states: dict[str, tuple[bytes, int]]) -> None:
    state, _ = tiny_states["auto"]
    stored = transcode(state, Target.of(StoreType.named("q4_0h/q8_0")))
    layers = parse(stored).layers
    fields = [struct.unpack_from("<i", stored, x.offset)[0] for x in layers]
    assert {f for x, f in zip(layers, fields, strict=True) if x.kind == "k"} == {Q4.ggml_id | ROTATED_FLAG}
    assert {f for x, f in zip(layers, fields, strict=True) if x.kind == "v"} == {Q8.ggml_id}
    assert all(x.rotated == (x.kind == "k") for x in layers)
    back = transcode(stored, Target(F16, F16))
    assert parse(back).types("k") == {"f16"} and len(back) == len(state)


def test_a_layer_may_take_its_own_coding(tiny_states: dict[str, tuple[bytes, int]]) -> None:
    state, _ = tiny_states["auto"]
    parsed = parse(state)
    second_k = [i for i, x in enumerate(parsed.layers) if x.kind == "k"][1]
    stored = parse(transcode(parsed, Target(Q8, Q4, {1: StoreType.named("q4_0h").k})))  # the second K layer
    codings = [x.coding.name for x in stored.layers]
    assert codings[second_k] == "q4_0h" and codings.count("q4_0h") == 1
    assert {c for x, c in zip(stored.layers, codings, strict=True) if x.kind == "k"} == {"q8_0", "q4_0h"}
    assert stored.types("v") == {"q4_0"}
