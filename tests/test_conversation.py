"""What a chat session stands for, and which part of the next rendering is new (client/conversation.py): pure
logic, no daemon."""

from __future__ import annotations

from dataclasses import asdict

from kvpool import protocol as p
from kvpool.client.conversation import Held, after_answer
from kvpool.gateway.conversations import Followed, Mapping


def final(reason: p.FinishReason = p.FinishReason.STOP, *, eog: bool = False, context: int = 50) -> p.Final:
    usage = p.Usage(prompt_tokens=40, completion_tokens=10, context_tokens=context)
    timings = p.Timings(queue_ms=0.0, ttft_ms=1.0, total_ms=2.0, decode_tokens_per_s=0.0)
    return p.Final(finish_reason=reason, eog=eog, usage=usage, timings=timings)


def test_the_next_rendering_continues_after_the_answer() -> None:
    held = after_answer("Sys\nUser: hi\nAssistant:", " Hello.", [5, 6], final())
    assert held is not None and held.tokens == 50
    assert held.rest("Sys\nUser: hi\nAssistant: Hello.\nUser: next\nAssistant:") == "\nUser: next\nAssistant:"


def test_whitespace_around_the_answer_is_not_compared() -> None:
    # A JSON answer right after "Assistant:", rendered back with the template's space; an answer's trailing
    # newline, trimmed by the template; a generation prompt's own trailing newline.
    held = after_answer("User: hi\nAssistant:", '{"a": 1}\n', [5], final())
    assert held is not None
    assert held.rest('User: hi\nAssistant: {"a": 1}\nUser: x\nAssistant:') == "\nUser: x\nAssistant:"
    held = after_answer("<turn>model\n", "{}", [5], final())
    assert held is not None and held.rest("<turn>model\n{}<end>\n<turn>user\nx") == "<end>\n<turn>user\nx"


def test_a_different_history_or_answer_is_not_continued() -> None:
    held = after_answer("User: hi\nAssistant:", " Hello.", [5], final())
    assert held is not None
    assert held.rest("User: ho\nAssistant: Hello.\nUser: x") is None  # an edited question
    assert held.rest("User: hi\nAssistant: Hullo.\nUser: x") is None  # an edited answer
    assert held.rest("User: hi\nAssistant: Hello.") is None  # nothing new


def test_only_a_finished_answer_can_be_continued() -> None:
    assert after_answer("x", "y", [1], None) is None
    assert after_answer("x", "y", [1], final(p.FinishReason.CANCELLED)) is None
    held = after_answer("x", "y", [7], final(p.FinishReason.STOP, eog=True))
    assert held is not None and held.eog_token == 7 and held.trim([7, 8]) == [8] and held.trim([8]) == [8]


def test_a_saved_record_of_another_shape_is_no_held_session() -> None:
    held = after_answer("x", "y", [1], final())
    assert held is not None
    assert Held.load(asdict(held)) == held
    assert Held.load({"tokens": 3, "text_chars": 4, "text_hash": "ab"}) is None  # an older record
    assert Held.load(None) is None and Held.load("x") is None
    # Written before a prefilled text was kept apart: the same Held when there was none, else started afresh.
    assert Held.load({**asdict(held), "then_chars": 0, "then_hash": ""}) == held
    assert Held.load({**asdict(held), "then_chars": 5, "then_hash": "ab"}) is None


def test_text_computed_after_the_answer_must_be_what_the_next_rendering_goes_on_with() -> None:
    held = after_answer("User: hi\nAssistant:", '{"call": 1}', [5, 2], final(eog=True, context=50))
    assert held is not None and held.eog_token == 2
    opening = '\nUser: {"result": "'
    ahead = Followed.after(held, opening, 56)
    assert ahead.tokens == 56 and ahead.trim([2, 9]) == [2, 9]  # the end of generation came before the opening
    assert ahead.text_chars == held.text_chars + len(opening)
    assert ahead.rest('User: hi\nAssistant: {"call": 1}\nUser: {"result": "ok"}\nAssistant:') == 'ok"}\nAssistant:'
    assert ahead.rest('User: hi\nAssistant: {"call": 1}\nUser: never mind\nAssistant:') is None
    assert ahead.rest('User: hi\nAssistant: {"call": 1}\nUser: {"result": "') is None  # nothing after it
    mapping = Mapping("s", "t", ahead)
    assert Mapping.from_json(mapping.to_json()) == mapping
    assert Mapping.from_json(Mapping("s", "t", held).to_json()) == Mapping("s", "t", held)
    assert Mapping.from_json({"session": "s", "token": "t", "followed": {"tokens": 3}}).held is None  # damaged


def test_the_opening_of_a_tools_result_is_read_off_the_template() -> None:
    from kvpool.client.chat_template import ChatTemplate, shipped
    from kvpool.gateway.messages import tool_result_text
    from kvpool.gateway.tool_result_prefill import ToolResultOpening

    for name in ("transcript", "chatml", "gemma3"):
        template = ChatTemplate(shipped(name), "<bos>", "<eos>")
        messages = [{"role": "user", "content": "lights"}]
        rendered = template.render(messages, add_generation_prompt=True)
        raw = '{"tool_calls": [{"name": "lamp", "arguments": {}}]}'
        held = after_answer(rendered, raw, [5], final())
        assert held is not None
        opening = ToolResultOpening(template, messages)
        one = opening.after(held, raw, ["lamp"])
        assert one is not None and one.endswith('{"tool_response": {"name": "lamp", "content": "'), name
        result = {"role": "user", "content": tool_result_text("lamp", "ok")}
        with_result = template.render([*messages, {"role": "assistant", "content": raw}, result], True)
        rest = held.rest(with_result)
        assert rest is not None and rest.startswith(one) and rest[len(one) :].startswith('ok"}}'), name
        # several calls: their results may come in any order, so the opening stops before the first one's name
        several = opening.after(held, raw, ["lamp", "timer"])
        assert several is not None and several.endswith('{"tool_response": {"name": "'), name
        assert opening.after(held, raw, []) is None
