"""A non-causal image wider than deterministic decoding's steps (64 cells, fed whole in one batch, which takes
llama.cpp's tiled flash attention) answers bit for bit as it does alone, whoever else holds cells in the KV:
real daemons on the tiny model with a Gemma 3-kind projector built by the suite (tests/tiny_mmproj.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvpool.client import Client, Image

from .daemon_process import DaemonProcess
from .tiny_mmproj import build_tiny_mmproj

FRAME = (np.arange(40 * 48 * 3) % 251).astype(np.uint8).reshape(40, 48, 3)
OTHER = np.ascontiguousarray(FRAME[::-1])
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def wide_mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "gemma3-wide.gguf"
    built = build_tiny_mmproj(path, "gemma3", vision={"image_size": 128})
    assert built["image_tokens"] == 64  # more than a deterministic step's 62 tokens
    return path


def answer(client: Client, prompt: list[object]) -> tuple[list[int], list[float]]:
    with client.open_session() as s:
        got = s.complete(prompt, max_tokens=12, logprobs=1, **GREEDY)
    return got.tokens, [lp.logprob for lp in got.logprobs]


def test_a_wide_image_answers_bit_for_bit_beside_other_sessions_cells(
    start_daemon: Callable[..., DaemonProcess], wide_mmproj: Path
) -> None:
    daemon = start_daemon(
        "--mmproj", str(wide_mmproj), "--context-size", "2048", "--hot-slots", "4", "--deterministic",
        "--threads", "2",
    )  # fmt: skip
    prompt = ["Look: ", Image(FRAME), " Describe it."]
    with Client(daemon.address) as client:
        alone = answer(client, prompt)
        # Two sessions stay resident and hold cells ahead of the next one's: 43 text cells (not a multiple of 64)
        # and another wide image.
        first, second = client.open_session(), client.open_session()
        first.complete("Boats and their sails, " * 3, max_tokens=5, **GREEDY)
        second.complete(["Other: ", Image(OTHER), " go on"], max_tokens=5, **GREEDY)
        compactions = client.status().moves.compactions
        beside = answer(client, prompt)
        assert client.status().moves.compactions > compactions  # its image step ran with it alone first in the KV
        # The others' cells came back after it: they go on as they would have.
        follow_up = first.complete(" and then", max_tokens=6, logprobs=1, **GREEDY)
    assert beside == alone
    assert len(alone[1]) == 12
    reference = start_daemon(
        "--mmproj", str(wide_mmproj), "--context-size", "2048", "--hot-slots", "4", "--deterministic",
        "--threads", "2", name="reference",
    )  # fmt: skip
    with Client(reference.address) as client, client.open_session() as s:
        s.complete("Boats and their sails, " * 3, max_tokens=5, **GREEDY)
        again = s.complete(" and then", max_tokens=6, logprobs=1, **GREEDY)
    assert [lp.logprob for lp in follow_up.logprobs] == [lp.logprob for lp in again.logprobs]
