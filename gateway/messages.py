"""OpenAI chat messages as a chat template reads them: roles and text, with tool calls and tool results in
kvpool's envelope format (tools.py), and the tools offered in the system message. Anything a message carries that
cannot be rendered is refused by name."""

from __future__ import annotations

import json

from kvpool.client.chat_template import ChatTemplate, TemplateError

from .http_errors import HttpError, refuse
from .media_parts import RequestMedia
from .schema import ChatMessage
from .tools import AnswerMemory, Toolbox, envelope_text

PART_FIELDS = ("text", "refusal", "image_url", "input_audio", "file")  # each is its own type's content only
MARK = "\u2063kvpool-answer\u2063"  # a text no template trims or rewrites, to find where an answer starts


def message_text(message: ChatMessage, where: str, media: RequestMedia | None = None) -> str | None:
    """A message's content as one text (text parts joined, each image or audio as its marker, media_parts.py);
    other parts are refused by name."""
    content = message.content
    if not isinstance(content, list):
        return content
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        for other in PART_FIELDS:
            if other != part.type and getattr(part, other) is not None:
                raise refuse(
                    f"{at}.{other}",
                    f"{at}: a {part.type} part carries no `{other}` (send it as a part of its own).",
                    "invalid_value",
                )
        if part.type == "refusal" and message.role == "assistant":
            texts.append(part.refusal or "")
        elif part.type in ("image_url", "input_audio") and media is not None and message.role in ("user", "system"):
            texts.append(
                media.image(part.image_url, at) if part.type == "image_url" else media.audio(part.input_audio, at)
            )
        elif part.type != "text":
            why = (
                f"only user and system messages carry {part.type} parts"
                if media is not None and part.type in ("image_url", "input_audio")
                else f"only text content is supported here, not {part.type} (the served model reads text)"
            )
            raise refuse(f"{where}.content[{k}]", f"{where}.content[{k}]: {why}.")
        elif part.prompt_cache_breakpoint is not None:
            raise refuse(
                f"{where}.content[{k}].prompt_cache_breakpoint",
                "`prompt_cache_breakpoint` is not "
                "supported: a conversation named by `prompt_cache_key` keeps all of its KV.",
            )
        else:
            texts.append(part.text or "")
    return "".join(texts)


def template_messages(
    messages: list[ChatMessage],
    toolbox: Toolbox | None,
    memory: AnswerMemory,
    answer_format: str = "",
    media: RequestMedia | None = None,
) -> list[dict[str, str]]:
    """The conversation for the chat template. An assistant answer the gateway reshaped (a call, a response out of
    its envelope) renders as the raw text the model generated when the gateway remembers it, so the session that
    holds it is continued; tool results become user messages ({"tool_response": ...}), merged with the user
    messages next to them (templates such as Gemma's require roles to alternate)."""
    out: list[dict[str, str]] = []
    from_tool: list[bool] = []  # whether each rendered message holds a tool result
    calls_by_id: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        for field in ("audio", "function_call"):
            if getattr(message, field) is not None:
                raise refuse(f"{where}.{field}", f"{where}.{field} is not supported (use tool_calls).")
        if message.annotations:
            raise refuse(
                f"{where}.annotations", f"{where}.annotations (citations) are not rendered: send them in the content."
            )
        if message.name is not None and message.role == "assistant":
            raise refuse(
                f"{where}.name",
                f"{where}.name: an assistant message's name is not rendered (its text must stay the answer the "
                "model gave); leave it out.",
            )
        if message.role == "function":
            raise refuse(f"{where}.role", "The `function` role is OpenAI's deprecated form: use `tool` messages.")
        if message.tool_calls and message.role != "assistant":
            raise refuse(f"{where}.tool_calls", f"{where}: only assistant messages carry tool_calls.")
        if message.tool_call_id is not None and message.role != "tool":
            raise refuse(f"{where}.tool_call_id", f"{where}: only tool messages carry tool_call_id.")
        text = message_text(message, where, media)
        if message.role == "assistant":
            if message.refusal is not None:
                if text:
                    raise refuse(f"{where}.refusal", f"{where}: send either `content` or `refusal`, not both.")
                text = message.refusal
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
            ids = [c.id for c in message.tool_calls or ()]
            for n, call_id in enumerate(ids):
                if call_id in ids[:n]:  # (a result names its call by id: one of two would get both results)
                    raise refuse(
                        f"{where}.tool_calls[{n}].id",
                        f"{where}.tool_calls[{n}].id {call_id!r} is an earlier call's too: each call needs its own.",
                        "invalid_value",
                    )
            calls_by_id.update((c.id, c.function.name) for c in message.tool_calls or ())
            raw = memory.recall(text, calls)
            if calls and text and raw is None:
                raise refuse(
                    f"{where}.content",
                    f"{where}.content: an assistant message with tool_calls is rendered as its calls alone (the model "
                    "answers either text or calls here), so its text would be dropped: leave it out.",
                    "invalid_value",
                )
            content = raw if raw is not None else envelope_text(calls) if calls else text or ""
            out.append({"role": "assistant", "content": content})
            from_tool.append(False)
        elif message.role == "tool":
            if message.tool_call_id is None:
                raise refuse(f"{where}.tool_call_id", f"{where}: a tool message needs the `tool_call_id` it answers.")
            name = calls_by_id.get(message.tool_call_id)
            if name is None:
                raise HttpError(
                    400,
                    f"{where}.tool_call_id: no earlier assistant message made the call {message.tool_call_id!r}.",
                    "invalid_value",
                    param=f"{where}.tool_call_id",
                )
            if message.name is not None and message.name != name:  # (the result's envelope names the call's tool)
                raise HttpError(
                    400,
                    f"{where}.name {message.name!r} is not the tool the call {message.tool_call_id!r} named "
                    f"({name!r}); send that name, or none.",
                    "invalid_value",
                    param=f"{where}.name",
                )
            _add_user(out, from_tool, tool_result_text(name, text or ""), tool=True)
        elif message.role == "user":
            _add_user(out, from_tool, named(message.name, text or ""), tool=False)
        else:  # system, developer
            out.append({"role": "system", "content": named(message.name, text or "")})
            from_tool.append(False)
    for note in (toolbox.offer() if toolbox is not None else "", answer_format):
        if note:
            _add_to_system(out, note)
    return out


def named(name: str | None, text: str) -> str:
    """A participant's message with its name (OpenAI's ``name``): the shipped templates render no names, so it
    goes before the content, as a transcript writes a speaker."""
    return f"{name}: {text}" if name else text


def tool_result_text(name: str, content: str) -> str:
    """A tool's result as the model reads it (in a user message)."""
    return json.dumps({"tool_response": {"name": name, "content": content}}, ensure_ascii=False)


def _add_to_system(out: list[dict[str, str]], note: str) -> None:
    """Instructions the request carries outside its messages (tools, response_format's description), appended to
    the first system message (or one of their own): the same for every turn, so earlier turns keep their KV."""
    system = next((m for m in out if m["role"] == "system"), None)
    if system is not None:
        system["content"] = f"{system['content']}\n\n{note}" if system["content"] else note
    else:
        out.insert(0, {"role": "system", "content": note})


def _add_user(out: list[dict[str, str]], from_tool: list[bool], content: str, tool: bool) -> None:
    if out and out[-1]["role"] == "user" and (tool or from_tool[-1]):
        out[-1]["content"] += "\n" + content
        from_tool[-1] = True
        return
    out.append({"role": "user", "content": content})
    from_tool.append(tool)


def answer_separator(template: ChatTemplate, messages: list[dict[str, str]], rendered: str) -> str:
    """What the template writes between the generation prompt and an assistant answer (the transcript's " " after
    "Assistant:"). A model writes it itself in free text, but a JSON answer cannot start with it: the prompt of a
    constrained answer ends with it instead, so the next turn's rendering starts with the text the session holds."""
    try:
        probe = template.render([*messages, {"role": "assistant", "content": MARK}], add_generation_prompt=False)
    except TemplateError:
        return ""
    at = probe.find(MARK)
    if at < 0 or not probe.startswith(rendered) or at < len(rendered):
        return ""
    separator = probe[len(rendered) : at]
    return separator if separator.isspace() else ""
