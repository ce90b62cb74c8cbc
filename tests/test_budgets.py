"""Latency budgets against a real daemon on the tiny model: deadlines first, preemption is exact, refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool import protocol as p
from kvpool.client.errors import BudgetUnmeetable, ContextOverflow
from kvpool.daemon.config import ConfigError, load_config

from .daemon_process import DaemonProcess
from .raw import RawConnection

Start = Callable[..., DaemonProcess]

CONFIG = """
[tasks.default]
[tasks.voice]
priority = 10
ttft_ms = 2000.0
tpot_ms = 1000.0
[tasks.vision]
ttft_ms = 600000.0
[tasks.background]
best_effort = true
[tasks.single]
max_queue = 1
"""


def first_chunks_order(daemon: DaemonProcess) -> list[int]:
    """Send a long vision prompt, then a short voice prompt at once; return the request ids in the order their
    first tokens arrived."""
    raw = RawConnection(daemon.address)
    try:
        vision, voice = raw.open("vision"), raw.open("voice")
        raw.send(
            p.Generate(
                id=10, session=vision.session, token=vision.token, prompt="v" * 6000, max_tokens=2, temperature=0.0
            )
        )
        raw.send(
            p.Generate(id=20, session=voice.session, token=voice.token, prompt="hello", max_tokens=2, temperature=0.0)
        )
        order: list[int] = []
        finals = 0
        while finals < 2:
            reply = raw.recv()
            assert not isinstance(reply, p.Error), reply
            if isinstance(reply, p.Chunk) and reply.id not in order:
                order.append(reply.id)
            finals += isinstance(reply, p.Final)
        return order
    finally:
        raw.close()


def test_voice_first_token_comes_before_a_long_vision_prefill_ends(start_daemon: Start) -> None:
    budgets = start_daemon("--context-size", "8192", "--batch-size", "64", config=CONFIG)
    assert first_chunks_order(budgets) == [20, 10]
    with budgets.client() as client:
        voice = client.status().tasks["voice"]
        assert voice.ttft_ms.count == 1 and voice.deadline_misses == 0
    # The control: first come first served makes the voice prompt wait behind the whole vision prompt.
    fcfs = start_daemon(
        "--context-size", "8192", "--batch-size", "64", "--scheduling", "fcfs", config=CONFIG, name="fcfs"
    )
    assert first_chunks_order(fcfs) == [10, 20]


def test_preempted_best_effort_generation_resumes_exactly(start_daemon: Start) -> None:
    # A session alone, run twice, runs the same batches only with its thread count fixed and without guesses: a
    # probe of another thread count, or a guess's rows, follow the step times measured, and either changes the
    # last bits of the logits, so 1500 sampled tokens may part at a near-tie (docs/determinism.md).
    daemon = start_daemon(
        "--hot-slots", "1", "--context-size", "4096", "--no-adapt-threads", "--draft-tokens", "0", config=CONFIG
    )
    raw = RawConnection(daemon.address)
    try:
        background, voice = raw.open("background"), raw.open("voice")
        raw.send(
            p.Generate(
                id=1,
                session=background.session,
                token=background.token,
                prompt="long story",
                max_tokens=1500,
                temperature=0.7,
                seed=42,
            )
        )
        assert isinstance(raw.recv(), p.Chunk)  # it is generating in the only slot
        raw.send(
            p.Generate(id=2, session=voice.session, token=voice.token, prompt="quick", max_tokens=3, temperature=0.0)
        )
        chunks, final = raw.until_final(1)
        assert final.finish_reason == p.FinishReason.LENGTH
        _, voice_final = raw.until_final(2)
        assert voice_final.usage.completion_tokens == 3
        assert voice_final.timings.ttft_ms < final.timings.total_ms  # voice did not wait for the background
        preempted_tokens = [t for c in chunks for t in c.tokens]
    finally:
        raw.close()
    with daemon.client() as client:
        status = client.status()
        assert status.tasks["background"].preemptions >= 1
        alone = client.open_session("background").complete("long story", max_tokens=1500, temperature=0.7, seed=42)
    # the first chunk was read before the voice request; the rest came around the preemption
    assert alone.tokens[1:] == preempted_tokens


def test_unmeetable_budget_is_refused_with_the_estimate(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG)
    with daemon.client() as client:
        voice = client.open_session("voice")
        with pytest.raises(BudgetUnmeetable) as refused:
            voice.complete("x" * 500, max_tokens=2, deadline_ms=0.001)
        assert refused.value.detail["estimate_ms"] > refused.value.detail["budget_ms"] == 0.001
        assert voice.complete("fine", max_tokens=2).usage.completion_tokens == 2  # nothing was lost
        assert client.status().tasks["voice"].refusals == {"BUDGET_UNMEETABLE": 1}
        # best-effort work is never refused for its budget
        background = client.open_session("background")
        assert background.complete("x" * 500, max_tokens=2, deadline_ms=0.001).usage.completion_tokens == 2


def test_queue_limit_answers_overloaded(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG)
    raw = RawConnection(daemon.address)
    try:
        a, b = raw.open("single"), raw.open("single")
        raw.send(p.Generate(id=1, session=a.session, token=a.token, prompt="a", max_tokens=1500, temperature=0.0))
        reply = raw.call(p.Generate(id=2, session=b.session, token=b.token, prompt="b", max_tokens=2))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.OVERLOADED and "max_queue" in reply.message
    finally:
        raw.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[tasks.default]\n[tasks.voice]\nttft_ms = -5", "`tasks.voice.ttft_ms` = -5"),
        ("[tasks.default]\n[tasks.voice]\ntpot_ms = 'fast'", "`tasks.voice.tpot_ms` = 'fast'"),
        ("[tasks.default]\n[tasks.voice]\nbest_effort = 3", "`tasks.voice.best_effort` = 3"),
        ("[tasks.default]\npriority = 1000", "`tasks.default.priority` = 1000"),
        ("scheduling = 'lottery'", "`scheduling` = 'lottery'"),
    ],
)
def test_bad_budget_values_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expected in str(err.value)


def test_requests_for_unknown_tasks_are_refused(start_daemon: Start) -> None:
    daemon = start_daemon(config=CONFIG)
    raw = RawConnection(daemon.address)
    try:
        reply = raw.call(p.OpenSession(id=3, task="navigation"))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.UNKNOWN_TASK
        assert "voice" in reply.message  # it lists the known ones
    finally:
        raw.close()


def test_calibration_at_start_can_be_turned_off(start_daemon: Start) -> None:
    calibrated = start_daemon("--hot-slots", "2", name="calibrated")
    prior = start_daemon("--hot-slots", "2", config="calibrate = false\n", name="prior")
    with calibrated.client() as client:
        assert len(client.status().scheduler.cost_model.calibration) > 0
    with prior.client() as client:
        cost = client.status().scheduler.cost_model
        assert cost.calibration == [] and cost.small_steps.fixed_ms == 10.0  # the prior, untouched by any step


def test_late_tokens_are_counted_while_the_answer_runs(start_daemon: Start) -> None:
    """`late tok` moved only when an answer ended: a status read mid-answer said 0 while the client had seen
    dozens of tokens past their budget."""
    daemon = start_daemon(config="[tasks.default]\n[tasks.paced]\ntpot_ms = 0.001\n")  # (no step is that quick)
    with daemon.client() as client, client.open_session("paced") as s:
        stream = s.generate("on and on", max_tokens=400, temperature=0.0)
        seen = 0
        for chunk in stream:
            seen += len(chunk.tokens)
            if seen >= 20:
                break
        assert client.status().tasks["paced"].late_tokens >= 10  # (mid-answer: it said 0 until the end)
        stream.close()


def test_a_tasks_own_system_prompt_too_long_for_its_sessions_is_named(start_daemon: Start) -> None:
    daemon = start_daemon("--context-size", "512", config=f'[tasks.default]\nsystem_prompt = "{"x" * 700}"\n')
    configured = r"Task 'default''s configured system_prompt \(tasks.default"
    with daemon.client() as client, pytest.raises(ContextOverflow, match=configured):
        client.open_session()  # (it read as if the client had sent a system prompt)
