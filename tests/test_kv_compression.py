"""KV compression per tier against real daemons on the tiny model: quantized hot KV, snapshots compressed in the
pool (always, and only under pressure) and on disk, prefixes, and a restart with another KV layout. What it costs
in quality is measured on the real model (bench/kv_quality.py) and bounded in test_gemma.py."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client import Client
from kvpool.client.cli import format_status
from kvpool.daemon.ops.prometheus import render

from .daemon_process import DaemonProcess, run_until_exit
from .tinymodel import build_tiny_model

Start = Callable[..., DaemonProcess]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def wide_heads_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 32-value heads: a quantized KV cache fits it."""
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "tiny-wide.gguf", heads=(2, 1))


def long_prompt(i: int) -> str:
    return f"session {i}: " + "".join(chr(97 + (i * 7 + j) % 26) for j in range(380))


def turns(client: Client, n: int, rounds: int, first: int = 380) -> tuple[dict[int, list[list[int]]], list]:
    """``n`` sessions, ``rounds`` greedy turns each, round-robin (each turn needs another resident session)."""
    sessions = [client.open_session() for _ in range(n)]
    out: dict[int, list[list[int]]] = {i: [] for i in range(n)}
    for r in range(rounds):
        for i, s in enumerate(sessions):
            prompt = long_prompt(i)[:first] if r == 0 else f" turn {r}"
            out[i].append(s.complete(prompt, max_tokens=4, **GREEDY).tokens)
    return out, sessions


# How far apart (in nats) the exact run's two most likely tokens may be where a compressed snapshot picks the second:
# q8_0 moves the tiny model's logits by hundredths, so a flip further apart than this is a broken snapshot.
NEAR_TIE = 0.5


def logprob_turns(client: Client, n: int, rounds: int, first: int = 380) -> dict[int, list[p.TokenLogprob]]:
    """turns(), with each session's tokens and their two most likely alternatives, all its turns in a row."""
    sessions = [client.open_session() for _ in range(n)]
    out: dict[int, list[p.TokenLogprob]] = {i: [] for i in range(n)}
    for r in range(rounds):
        for i, s in enumerate(sessions):
            prompt = long_prompt(i)[:first] if r == 0 else f" turn {r}"
            out[i].extend(s.complete(prompt, max_tokens=4, logprobs=2, **GREEDY).logprobs)
    return out


def agree_but_at_near_ties(approx: dict[int, list[p.TokenLogprob]], exact: dict[int, list[p.TokenLogprob]]) -> None:
    """The compressed run's greedy tokens are the exact run's, up to a place where the exact run's top two were
    within NEAR_TIE and the compressed one took the other (which no float tolerance can rule out); from there that
    session's context differs, so the comparison ends for it."""
    assert approx.keys() == exact.keys()
    for i, tokens in exact.items():
        assert len(approx[i]) == len(tokens)
        for a, e in zip(approx[i], tokens, strict=True):
            if a.token != e.token:
                gap = e.top[0].logprob - e.top[1].logprob
                assert gap < NEAR_TIE and a.token == e.top[1].token, (i, a, e)
                break
            assert abs(a.logprob - e.logprob) < NEAR_TIE, (i, a, e)


def config(**keys: str) -> str:
    return "".join(f'{k} = "{v}"\n' for k, v in keys.items())


def test_a_quantized_hot_kv_hibernates_and_restores_exactly(start_daemon: Start, wide_heads_model: Path) -> None:
    args = ("--cache-type-k", "q8_0", "--cache-type-v", "q4_0", "--context-size", "2048")
    tight = start_daemon(*args, "--hot-slots", "1", model=wide_heads_model, name="tight")
    with tight.client() as client:
        model = client.status().model
        assert (model.kv_type_k, model.kv_type_v, model.flash_attn) == ("q8_0", "q4_0", True)
        hibernating, _ = turns(client, 3, 2, first=60)
        status = client.status()
        assert status.moves.restores_pool >= 3 and status.moves.compressions == 0
        assert {s.kv_type for s in client.sessions()} == {"q8_0/q4_0"}  # stored at the hot types, as they are
    roomy = start_daemon(*args, "--hot-slots", "3", model=wide_heads_model, name="roomy")
    with roomy.client() as client:
        resident, _ = turns(client, 3, 2, first=60)
        assert client.status().moves.hibernations == 0
    assert hibernating == resident


def test_a_kv_type_the_model_cannot_hold_is_refused_at_start(
    start_daemon: Start, tiny_model: Path, wide_heads_model: Path
) -> None:
    daemon = start_daemon(wait=False)
    wide = [arg if arg != str(tiny_model) else str(wide_heads_model) for arg in daemon.command()]
    checked = run_until_exit([*wide, "--check-config", "--cache-type-v", "q4_0"])
    assert checked.returncode == 0, checked.stderr
    assert "hot KV: K f16, V q4_0, flash attention on; flash attention on (auto: required by" in checked.stderr
    narrow = run_until_exit([*daemon.command(), "--cache-type-k", "q8_0"])
    assert narrow.returncode == 2 and "16 values" in narrow.stderr and "use f16" in narrow.stderr
    no_fa = run_until_exit([*daemon.command(), "--cache-type-v", "q8_0", "--flash-attn", "off"])
    assert no_fa.returncode == 2 and "needs flash attention" in no_fa.stderr
    daemon.stop()


def test_pool_snapshots_compressed_as_written_come_back_at_the_hot_types(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", config=config(pool_kv_type="q8_0", pool_kv_policy="always"))
    with daemon.client() as client:
        compressed = logprob_turns(client, 3, 3)
        status = client.status()
        assert status.moves.compressions >= 6 and status.moves.restores_decompressed >= 6
        pool = status.pool
        assert pool.kv_type == "q8_0" and pool.compressed_snapshots == pool.snapshots == 3
        assert pool.compression_ratio > 1.7  # f16 rows of 32 values: 64 bytes; q8_0: 34
        assert {s.kv_type for s in client.sessions() if s.tier == "pool"} == {"q8_0"}
        text = format_status(status)
        assert "K f16, V f16, flash attention on" in text and "kv q8_0: 3 of 3 snapshots compressed" in text
        exposition = render(status, {})
        stored = f'kvpool_tier_snapshot_bytes{{kind="stored",tier="pool"}} {float(pool.snapshot_bytes)}'
        assert stored in exposition and 'kvpool_tier_compressed_snapshots{tier="pool"} 3.0' in exposition
    exact = start_daemon("--hot-slots", "1", name="exact")
    with exact.client() as client:
        uncompressed = logprob_turns(client, 3, 3)
        assert client.status().moves.compressions == 0
    agree_but_at_near_ties(compressed, uncompressed)


def test_k_and_v_at_their_own_types_and_rotated_rows_come_back_at_the_hot_types(start_daemon: Start) -> None:
    """K at q8_0, V at q4_0 rotated (the frontier docs/kv-compression.md measured): each half at its own coding,
    named so in status, and the answers those of the exact run but at near ties."""
    daemon = start_daemon("--hot-slots", "1", config=config(pool_kv_type="q8_0/q4_0h", pool_kv_policy="always"))
    with daemon.client() as client:
        compressed = logprob_turns(client, 2, 3)
        status = client.status()
        assert status.moves.restores_decompressed >= 4 and status.pool.kv_type == "q8_0/q4_0h"
        # f16 rows of 32 values: 64 + 64 bytes; q8_0 K 34, q4_0 V 18
        assert 2.0 < status.pool.compression_ratio < 128 / 52
        assert {s.kv_type for s in client.sessions() if s.tier == "pool"} == {"q8_0/q4_0h"}
    exact = start_daemon("--hot-slots", "1", name="exact")
    with exact.client() as client:
        agree_but_at_near_ties(compressed, logprob_turns(client, 2, 3))


def fill(daemon: DaemonProcess, n: int) -> object:
    with daemon.client() as client:
        turns(client, n, 1)
        return client.status()


def test_a_full_pool_compresses_its_least_recently_used_snapshots_before_it_spills(start_daemon: Start) -> None:
    # 12 sessions of ~400 tokens: ~1.3 MB of f16 snapshots for a pool of 1 MiB, ~0.7 MB at q8_0.
    small = ("--hot-slots", "1", "--cache-pool-size", "1MiB")
    plain = fill(start_daemon(*small, name="plain"), 12)
    assert plain.moves.spills > 0 and plain.pool.compressed_snapshots == 0
    squeezed = start_daemon(*small, config=config(pool_kv_type="q8_0"), name="squeezed")
    with squeezed.client() as client:
        _, sessions = turns(client, 12, 1)
        status = client.status()
        assert status.moves.spills == 0 and status.sessions_by_tier == {"hot": 1, "pool": 11}
        assert 0 < status.pool.compressed_snapshots < status.pool.snapshots  # the newest stay at the hot types
        assert status.pool.compression_ratio > 1.1 and status.pool.kv_policy == "when_full"
        stored = {s.session: s.kv_type for s in client.sessions() if s.tier == "pool"}
        assert set(stored.values()) == {"q8_0", "f16"}
        assert stored[sessions[0].id] == "q8_0"  # the least recently used went first
        for s in sessions:
            assert s.complete(" more", max_tokens=2, **GREEDY).usage.completion_tokens == 2
        assert client.status().moves.restores_decompressed >= status.pool.compressed_snapshots


def test_spilled_snapshots_are_stored_at_the_spill_type_and_restore(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", "--cache-pool-size", "1MiB", config=config(spill_kv_type="q4_0"))
    with daemon.client() as client:
        _, sessions = turns(client, 12, 1)
        status = client.status()
        assert status.moves.spills > 0 and status.spill.kv_type == "q4_0"
        assert status.spill.compressed_snapshots == status.spill.snapshots > 0
        assert status.spill.compression_ratio > 3.0
        on_disk = [s.session for s in client.sessions() if s.tier == "disk"]
        assert on_disk and all(s.kv_type == "q4_0" for s in client.sessions() if s.tier == "disk")
        for s in sessions:
            if s.id in on_disk:
                assert s.complete(" more", max_tokens=3, **GREEDY).usage.completion_tokens == 3
        assert client.status().moves.restores_disk >= len(on_disk)


def test_shared_prefixes_keep_working_with_compressed_suffixes(start_daemon: Start) -> None:
    system = "You are a helpful assistant on a small device. " * 6
    toml = config(pool_kv_type="q8_0", pool_kv_policy="always") + f'[tasks.default]\nsystem_prompt = "{system}"\n'
    daemon = start_daemon("--hot-slots", "1", config=toml)
    with daemon.client() as client:
        compressed = logprob_turns(client, 3, 3, first=40)
        status = client.status()
        assert status.prefixes.hits >= 2 and status.moves.restores_decompressed >= 4
        assert all(info.shared_tokens > 0 for info in client.sessions())
        assert status.pool.compressed_snapshots == 3  # the sessions' own cells; the prefix stays exact
    exact = start_daemon("--hot-slots", "1", config=f'[tasks.default]\nsystem_prompt = "{system}"\n', name="exact")
    with exact.client() as client:
        agree_but_at_near_ties(compressed, logprob_turns(client, 3, 3, first=40))


def test_a_restart_with_another_kv_layout_refuses_the_pool_and_loses_nothing(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1")
    with daemon.client() as client:
        s = client.open_session()
        first = s.complete("remember this", max_tokens=3, **GREEDY).tokens
        sid, token = s.id, s.token
    assert daemon.stop() == 0
    refused = run_until_exit([*daemon.command(), "--flash-attn", "off"])
    assert refused.returncode == 1
    assert "k=f16,v=f16,fa=1" in refused.stderr and "fa=0" in refused.stderr and "--reset-pool" in refused.stderr
    daemon.start()  # the old setting again: every session is still there
    with daemon.client() as client:
        again = client.resume_session(sid, token)
        assert client.status().sessions.open == 1 and again.history()[-len(first) :] == first
        assert again.complete(" and go on", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_compressed_snapshots_survive_a_crash(start_daemon: Start) -> None:
    daemon = start_daemon("--hot-slots", "1", config=config(pool_kv_type="q4_0", pool_kv_policy="always"))
    with daemon.client() as client:
        _, sessions = turns(client, 2, 2, first=60)
        ids = [(s.id, s.token) for s in sessions]
        assert client.status().pool.compressed_snapshots == 2
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client() as client:
        status = client.status()
        assert status.sessions.open == 2 and status.pool.compressed_snapshots == 2
        for sid, token in ids:
            resumed = client.resume_session(sid, token)
            assert resumed.complete(" again", max_tokens=2, **GREEDY).usage.completion_tokens == 2
        assert client.status().moves.restores_decompressed == 2
