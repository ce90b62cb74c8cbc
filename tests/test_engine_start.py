"""What the engine does before its first step, in this process on the fake model: one-time work that a first
request would otherwise pay in the middle of its answer, stalling every session's step."""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path

import pytest

from kvpool.daemon.llama.model.tokenizer import Tokenizer

from .fake_model import FakeModel
from .kv_in_process import open_session
from .test_engine_failures import CLIENT, WAIT_S, engine_on_fake_model, generate


def byte_table_reads(tmp: Path, jump_forward: str, draft_tokens: int = 16) -> list[int]:
    """The decodes done each time the engine read the vocabulary's byte table, over a start and one answer."""
    with engine_on_fake_model(tmp, jump_forward=jump_forward, draft_tokens=draft_tokens) as (engine, replies):
        model: FakeModel = engine.model  # type: ignore[assignment]
        thread = threading.Thread(target=engine.run, name="engine")
        thread.start()
        try:
            engine.submit(CLIENT, generate(1, open_session(engine.kv), prompt=5))
            replies.wait_last(1)
        finally:
            engine.stopping.set()
            thread.join(WAIT_S)
        assert not thread.is_alive()
        assert model.decodes > 0
        return model.byte_tokens_read


@pytest.mark.parametrize(("jump_forward", "draft_tokens"), [("guess", 16), ("append", 16), ("off", 16), ("guess", 0)])
def test_the_byte_table_a_grammar_is_asked_with_is_read_before_the_first_step(
    tmp_path: Path, jump_forward: str, draft_tokens: int
) -> None:
    # (Gemma 3's table is a pass over 262k tokens, 0.4 s: read by the first JSON answer, it stalled the step loop.
    # Every setting reads it: without forced text, a greedy constrained answer asks with it for the best token its
    # grammar allows where it refused the likeliest ones.)
    assert byte_table_reads(tmp_path, jump_forward, draft_tokens) == [0]


def test_the_real_byte_table_is_read_once_and_kept() -> None:
    assert isinstance(Tokenizer.__dict__["_vocabulary_bytes"], cached_property)
