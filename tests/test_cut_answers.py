"""Pure logic of truthful endings, no daemon: which replies are cuts, how the client libraries raise them, and
that the gateway can never shape an answer that did not end normally as a finished one."""

from __future__ import annotations

import asyncio

import pytest

from kvpool import protocol as p
from kvpool.client.errors import ClientUnresponsive, KvpoolError, ShuttingDown
from kvpool.client.results import raise_if_error
from kvpool.gateway.generations import _next
from kvpool.gateway.http_errors import HttpError
from kvpool.gateway.shaping import ChoiceFormat, ChoiceState


def final(reason: p.FinishReason, completion: int = 5, context: int = 40) -> p.Final:
    usage = p.Usage(prompt_tokens=10, completion_tokens=completion, context_tokens=context)
    return p.Final(
        finish_reason=reason, usage=usage, timings=p.Timings(queue_ms=0, ttft_ms=1, total_ms=2, decode_tokens_per_s=0)
    )


def test_a_cut_error_says_what_the_session_kept_and_a_refusal_does_not() -> None:
    cut = p.Error(code=p.ErrorCode.CLIENT_UNRESPONSIVE, message="m", detail=p.cut_detail(7, 30))
    with pytest.raises(ClientUnresponsive) as raised:
        raise_if_error(cut)
    assert raised.value.cut and raised.value.detail == {"completion_tokens": 7, "context_tokens": 30}
    with pytest.raises(ShuttingDown) as refused:
        raise_if_error(p.Error(code=p.ErrorCode.SHUTTING_DOWN, message="m"))
    assert not refused.value.cut
    conflict = p.Error(code=p.ErrorCode.CONFLICT, message="m", detail={"context_tokens": 40, "after": 30})
    with pytest.raises(KvpoolError) as mismatch:  # a refusal that names the session's context is no cut
        raise_if_error(conflict)
    assert not mismatch.value.cut


def test_an_older_daemons_shutdown_finish_raises_as_a_cut() -> None:
    with pytest.raises(ShuttingDown) as raised:
        raise_if_error(final(p.FinishReason.SHUTDOWN, completion=3, context=20))
    assert raised.value.cut and raised.value.detail == p.cut_detail(3, 20)
    for reason in (p.FinishReason.STOP, p.FinishReason.LENGTH, p.FinishReason.CANCELLED):
        assert raise_if_error(final(reason)).finish_reason == reason  # the ends a client asked for


class Ended:
    """A stream that has ended with ``final`` (the shape of AsyncStream the gateway reads)."""

    def __init__(self, final: p.Final):
        self.final = final

    def __aiter__(self) -> Ended:
        return self

    async def __anext__(self) -> p.Chunk:
        raise StopAsyncIteration


def test_the_gateway_reports_an_answer_cancelled_by_someone_else_as_an_error() -> None:
    with pytest.raises(KvpoolError) as raised:
        asyncio.run(_next(Ended(final(p.FinishReason.CANCELLED))))  # type: ignore[arg-type]
    error = HttpError.from_kvpool(raised.value.code, raised.value.message)
    assert error.status == 409 and error.code == "cancelled" and raised.value.cut
    assert asyncio.run(_next(Ended(final(p.FinishReason.LENGTH)))).finish_reason == "length"  # type: ignore[arg-type]


@pytest.mark.parametrize("reason", [p.FinishReason.CANCELLED, p.FinishReason.SHUTDOWN, None])
def test_a_choice_that_did_not_end_normally_has_no_finish_reason(reason: p.FinishReason | None) -> None:
    state = ChoiceState(0, ChoiceFormat(chat=True))
    state.final = final(reason) if reason is not None else None
    with pytest.raises(RuntimeError):
        state.finish_reason()


@pytest.mark.parametrize(
    ("code", "status"),
    [("CLIENT_UNRESPONSIVE", 503), ("KV_FULL", 503), ("SHUTTING_DOWN", 503), ("UNAVAILABLE", 503), ("TIMEOUT", 504)],
)
def test_cuts_and_a_missing_daemon_are_statuses_a_client_retries(code: str, status: int) -> None:
    error = HttpError.from_kvpool(code, "m")
    assert error.status == status
    assert error.response().headers.get("retry-after") == ("1" if status == 503 else None)
