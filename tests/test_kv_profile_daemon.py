"""Precision profiles end to end on the tiny model: `kvpool-kv-profile` measures one and writes it, a daemon stores
its pool by one (K layers at codings of their own) and restores the answers an exact daemon gives up to near ties,
and a daemon refuses a profile measured for another model, or none, at start. Choosing the default model's profile
is measured on the real model (docs/kv-compression.md)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from kvpool.daemon.kv.codec.precision_profile import read_profile
from kvpool.daemon.llama.model.loading import fingerprint

from .daemon_process import DaemonProcess, run_until_exit
from .test_kv_compression import agree_but_at_near_ties, config, logprob_turns, long_prompt
from .tinymodel import N_LAYER, build_tiny_model

Start = Callable[..., DaemonProcess]


def handwritten(path: Path, model: Path, **fields: object) -> Path:
    """K at q4_0 but the second K layer at q8_0, V at q8_0 (rows of 32 values: f16 64 bytes, q8_0 34, q4_0 18)."""
    body = {"kvpool_kv_profile": 1, "model": model.name, "fingerprint": fingerprint(model), "k": "q4_0", "v": "q8_0"}
    path.write_text(json.dumps(body | {"k_layers": {"1": "q8_0"}} | fields))
    return path


def test_a_pool_stored_by_a_profile_keeps_its_layers_and_the_answers(
    start_daemon: Start, tiny_model: Path, tmp_path: Path
) -> None:
    profile = handwritten(tmp_path / "tiny.kvprofile.json", tiny_model)
    toml = config(pool_kv_type="profile", pool_kv_policy="always", kv_profile=str(profile))
    daemon = start_daemon("--hot-slots", "1", config=toml)
    with daemon.client() as client:
        compressed = logprob_turns(client, 2, 3)
        status = client.status()
        assert status.moves.restores_decompressed >= 4
        assert status.pool.kv_type == "profile: q4_0/q8_0 by layer"
        assert {s.kv_type for s in client.sessions() if s.tier == "pool"} == {"q4_0/q8_0 by layer"}
        # Per cell, with its 12-byte record: f16 4 x 64 + 12 = 268 bytes; this profile 18 + 34 + 2 x 34 + 12 = 132
        # (2.03x). Every K layer at q4_0 would be 116 (2.31x), every one at q8_0 148 (1.81x).
        assert 1.9 < status.pool.compression_ratio < 2.2
        kept = client.open_session()
        kept.complete(long_prompt(7)[:200], max_tokens=2, temperature=0.0)
        sid, token = kept.id, kept.token
    exact = start_daemon("--hot-slots", "1", name="exact")
    with exact.client() as client:
        agree_but_at_near_ties(compressed, logprob_turns(client, 2, 3))
    # The pool's records name the profile's type, and a daemon that was killed reads them back
    daemon.stop(signal.SIGKILL)
    daemon.start()
    with daemon.client() as client:
        assert {s.kv_type for s in client.sessions()} == {"q4_0/q8_0 by layer"}
        resumed = client.resume_session(sid, token)
        assert resumed.complete(" again", max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        assert client.status().moves.restores_decompressed == 1


def test_a_profile_for_another_model_or_none_is_refused_at_start(
    start_daemon: Start, tiny_model: Path, tmp_path: Path
) -> None:
    other = build_tiny_model(tmp_path / "other.gguf", seed=1)
    daemon = start_daemon(wait=False)
    foreign = handwritten(tmp_path / "other.kvprofile.json", other)
    refused = run_until_exit([*daemon.command(), "--pool-kv-type", "profile", "--kv-profile", str(foreign)])
    assert refused.returncode == 2, refused.stderr
    assert f"measured for another model (other.gguf, fingerprint {fingerprint(other)})" in refused.stderr
    assert f"kvpool-kv-profile --model {tiny_model}" in refused.stderr
    none = run_until_exit([*daemon.command(), "--spill-kv-type", "profile"])
    assert none.returncode == 2 and f"there is none for {tiny_model.name}" in none.stderr, none.stderr
    unused = run_until_exit([*daemon.command(), "--kv-profile", str(foreign)])
    assert unused.returncode == 2 and "no tier stores by it" in unused.stderr, unused.stderr
    daemon.stop()


def test_the_command_measures_a_profile_a_daemon_starts_with(
    start_daemon: Start, tiny_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "measured.kvprofile.json"
    command = [sys.executable, "-m", "kvpool.daemon.llama.profile_command", "--model", str(tiny_model)]
    sizes = ["--context", "96", "--score", "32", "--windows", "2", "--threads", "2", "--out", str(out)]
    # Any KLD and top-1 allowed: every K layer is lowered to q4_0, and the profile measured so
    anything = ["--most-kld", "1e9", "--top1-points", "100"]
    done = run_until_exit([*command, *sizes, "--low", "q4_0", *anything], timeout=300)
    assert done.returncode == 0, done.stderr
    profile = read_profile(out)
    assert profile.fingerprint == fingerprint(tiny_model) and (profile.k, profile.v) == ("q4_0", "q4_0h")
    assert profile.k_layers == {} and profile.measured is not None
    m = profile.measured
    assert m.positions == 64 and m.context == 96 and m.lowered == "q4_0"
    assert sorted(m.layer_kld) == list(range(N_LAYER)) and all(m.layer_saving[j] > 0 for j in range(N_LAYER))
    assert m.kld > 0 and m.floor_kld > 0 and m.vs_f16 > 1.0
    assert f"{out}: K q4_0, V q4_0h" in done.stdout
    # No KLD allowed: nothing is lowered, and K keeps the base's coding
    done = run_until_exit([*command, *sizes, "--most-kld", "0"], timeout=300)
    assert done.returncode == 0, done.stderr
    assert (read_profile(out).k, read_profile(out).k_layers) == ("q8_0", {})
    daemon = start_daemon("--spill-kv-type", "profile", "--kv-profile", str(out))
    with daemon.client() as client:
        assert client.status().spill.kv_type == "profile: q8_0/q4_0h by layer"
    bad = run_until_exit([*command, "--base", "q3_k"])
    assert bad.returncode == 2 and "no store type" in bad.stderr, bad.stderr


def test_the_commands_bad_usage_is_said_before_anything_is_measured(tiny_model: Path, tmp_path: Path) -> None:
    """Each was a segfault, a traceback or a profile measured on nothing; and a place the profile cannot be written
    was found only after the measurement (minutes on the default model)."""
    command = [sys.executable, "-m", "kvpool.daemon.llama.profile_command", "--model", str(tiny_model)]
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"not a model at all")
    for args, said in (
        (["--score", "-4"], "--score: -4 is less than 1"),
        (["--context", "0"], "--context: 0 is less than 1"),
        (["--windows", "0"], "--windows: 0 is less than 1"),
        (["--most-kld", "nan"], "--most-kld: nan is not a finite number"),
        (["--top1-points", "-50"], "--top1-points: -50 is not a finite number of at least 0"),
        (["--out", str(tmp_path / "missing" / "p.json")], "cannot write"),
    ):
        done = run_until_exit([*command, *args], timeout=60)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    done = run_until_exit([sys.executable, "-m", "kvpool.daemon.llama.profile_command", "--model", str(not_gguf)])
    assert done.returncode == 2 and "not a GGUF file" in done.stderr and "Traceback" not in done.stderr
