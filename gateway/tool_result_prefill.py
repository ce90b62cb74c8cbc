"""What the next request of a tool loop begins with, so that it is computed while the tool runs.

A client that gets tool calls sends their results next (OpenAI's API requires a tool message for each call right
after the assistant message that made them), so the next rendering goes on from the answer with the template's
end of turn, a user turn and ``{"tool_response": {"name": "<the first call's name>", "content": "`` (the name is
left out when several calls came: their results may come in any order). Once the call's turn is over, the gateway
prefills that opening into the conversation's session (turns.py), and the request that carries the result computes
only the rest. A next request that does not go on with it (a history edited, a result left out) starts a new
session, as any conversation that does not continue its session does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.client.aio import AsyncClient
from kvpool.client.chat_template import ChatTemplate, TemplateError
from kvpool.client.conversation import Held

from .messages import MARK, tool_result_text

# Tool results the opening's tokens are checked against: its tokens must be those the whole rendering has, whatever
# the result (a tokenizer may merge the quote that opens the content with what follows it).
SAMPLE_RESULTS = ("ok", "18 C, light rain", '"quoted"', " spaced", "{", "Done.")
MAX_CUT = 8  # characters the opening may give up at its end for that


@dataclass(frozen=True)
class ToolResultOpening:
    """The rendering of a request's conversation, to find what follows its answer when that answer is a call."""

    template: ChatTemplate
    messages: list[dict[str, str]]  # the request's conversation as the template reads it (messages.py)

    def after(self, held: Held, raw_answer: str, names: list[str]) -> str | None:
        """The text the rendering with the calls' results goes on with after the answer ``held`` stands for, up to
        the first result's content (None: the template does not write it after the answer)."""
        if not names:
            return None
        name = names[0] if len(names) == 1 else MARK
        probe = [
            *self.messages,
            {"role": "assistant", "content": raw_answer},
            {"role": "user", "content": tool_result_text(name, MARK)},
        ]
        try:
            rendered = self.template.render(probe, add_generation_prompt=True)
        except TemplateError:
            return None
        rest = held.rest(rendered)
        if rest is None or MARK not in rest:
            return None
        return rest[: rest.index(MARK)] or None


async def stable_start(client: AsyncClient, text: str, special: bool) -> tuple[str, list[int]] | None:
    """The longest start of ``text`` (it may leave out a few characters at its end) whose tokens are the ones any
    result after it would be tokenized with, and those tokens; None when there is none."""
    tokenized = [await client.tokenize(text + sample, add_bos=False, special=special) for sample in SAMPLE_RESULTS]
    differ = (i for i, column in enumerate(zip(*tokenized, strict=False)) if len(set(column)) > 1)
    common = tokenized[0][: next(differ, min(map(len, tokenized)))]
    for cut in range(len(text), max(0, len(text) - MAX_CUT), -1):
        tokens = await client.tokenize(text[:cut], add_bos=False, special=special)
        if tokens and tokens == common[: len(tokens)]:
            return text[:cut], tokens
    return None
