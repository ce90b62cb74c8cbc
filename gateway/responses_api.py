"""OpenAI's Responses API on kvpool's stateful sessions: ``POST /v1/responses``, and the stored responses.

A request is translated into the chat route's (``instructions`` as the system message, ``input`` items as messages:
``message`` with ``input_text`` / ``input_image`` / ``output_text`` parts, ``function_call`` as an assistant's tool
call, ``function_call_output`` as its tool result; function ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``text.format``, ``max_output_tokens``, ``temperature``, ``top_p``, ``user``), so each field is honoured or refused
as the chat route does. ``previous_response_id`` puts the stored conversation of that response before the new
input, and the chain continues its conversation's session (a named one with ``prompt_cache_key``, else found by its
history, turns.py): the session holds the chain's KV, so a chained request computes only its new input, after a
gateway or a daemon restart too. A response
is stored (``store``, default true) with the conversation it ends, in responses_store.py: bounded, persisted,
expiring. What it cannot honour (built-in tools, ``background``, ``reasoning``, ``conversation`` objects, stored
``prompt`` templates) is refused by name.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from kvpool.client.errors import KvpoolError

from . import fields
from .http_errors import HttpError, Whole, refuse
from .shaping import ChoiceState
from .streaming import Stream, first_choice_deltas

UNSERVED = {  # field -> why it is refused when set
    "background": "responses are answered while the request waits (no background mode)",
    "conversation": "conversations are chained with previous_response_id (no conversation objects)",
    "prompt": "stored prompt templates are not kept here; send the instructions and input",
    "reasoning": "the served model has no reasoning",
    "context_management": "the context is kept whole, in the session's KV",
    "moderation": "no moderation is run here",
    "access_programs": "not served here",
    "image": "not served here",
    "background_options": "responses are answered while the request waits (no background mode)",
    "prompt_cache_options": "every chain keeps all of its KV",
    "max_tool_calls": "the model's calls are returned whole; bound them in the tools offered",
    "top_logprobs": "log-probabilities are served on /v1/chat/completions",
    "prompt_cache_retention": "a chain's KV is kept until the daemon's session_timeout",
}
# The chat route's fields as a Responses request names them, for its errors (HttpError.renamed); its messages are
# named by chat_request, since a chat message's index is not its input item's (instructions, the chain, merged calls).
CHAT_NAMES = {
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
}
TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
FORMAT_KEYS = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "name", "schema", "strict", "description"),
}
BUILT_IN_TOOLS = "web search, file search, code interpreter, computer use, image generation, MCP, shell"


class ResponsesRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    image: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def refuse_unserved(request: ResponsesRequest) -> None:
    for name, why in UNSERVED.items():
        value = getattr(request, name)
        if value is not None and value is not False and value != {} and not (name == "reasoning" and _no_effort(value)):
            raise refuse(name, f"`{name}` is not supported: {why}.")
    for name in request.include or ():
        raise refuse("include", f"`include` {name!r} is not served: nothing extra is kept with a response here.")
    if request.stream_options is not None:
        if not request.stream:
            raise refuse("stream_options", "`stream_options` goes with `stream`: true.")
        for name, value in request.stream_options.items():
            if name == "include_obfuscation" and value:
                raise fields.refuse_obfuscation()
            if name != "include_obfuscation":
                raise refuse(
                    f"stream_options.{name}", f"`stream_options.{name}` is not an option here.", "invalid_value"
                )
    for name, value in (request.text or {}).items():
        if name == "verbosity" and value is not None:
            raise refuse(
                "text.verbosity",
                "`text.verbosity` is not supported: ask for the length you want in the instructions, or set "
                "max_output_tokens.",
            )
        if name not in ("format", "verbosity"):
            raise refuse(f"text.{name}", f"`text.{name}` is not an option here (`text.format` is).", "invalid_value")
    if request.truncation == "auto":
        raise refuse(
            "truncation",
            "`truncation` auto is not supported: an input longer than the context is refused, never cut; "
            "shorten the input or start a new chain.",
            "unsupported_value",
        )


def _no_effort(reasoning: Any) -> bool:
    """``reasoning`` that asks for nothing (an SDK's empty default)."""
    return isinstance(reasoning, dict) and all(v is None for v in reasoning.values())


def _translated(items: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]]]:
    """The input items as chat messages, and where each came from: (message, a path in it, the item's path)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [(0, "", "input")]
    if not items:
        raise refuse("input", "`input` has no items: send the new turn as text or as items.", "invalid_value")
    out: list[dict[str, Any]] = []
    origins: list[tuple[int, str, str]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
            origins.append((len(out) - 1, "", where))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", where),
                "type": "function",
                "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # (parallel calls come as items one after the other)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((len(out) - 1, "", where))
            at = f".tool_calls[{len(out[-1]['tool_calls']) - 1}]"
            origins += [
                (len(out) - 1, f"{at}.id", f"{where}.call_id"),
                (len(out) - 1, f"{at}.function", where),
                (len(out) - 1, at, where),
            ]
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # (content parts: their text)
                output = "".join(_part_text(part, f"{where}.output[{k}]") for k, part in enumerate(output))
            if not isinstance(output, str):
                raise refuse(f"{where}.output", f"{where}.output is the call's result as text.")
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": output})
            origins += [(len(out) - 1, ".tool_call_id", f"{where}.call_id"), (len(out) - 1, "", where)]
        elif kind == "reasoning":
            raise refuse(where, f"{where}: reasoning items are not read (the served model has no reasoning).")
        else:
            raise refuse(where, f"{where}: {kind!r} items are not served here (messages and function calls are).")
    return out, origins


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise refuse(f"{where}.role", f"{where}.role is user, system, developer or assistant, not {role!r}.")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise refuse(f"{where}.content", f"{where}.content is text or a list of content parts.")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            parts.append({"type": "text", "text": _part_text(part, at)})
        elif role == "assistant":
            raise refuse(at, f"{at}: an assistant message's parts are text ({kind!r} is not).")
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise refuse(at, f"{at}: an input_image names its image_url (a data: URL); file ids are not kept here.")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail", "auto")}})
        elif kind == "input_audio":
            parts.append({"type": "input_audio", "input_audio": part.get("input_audio")})
        else:
            raise refuse(at, f"{at}: {kind!r} parts are not served here (text and images are).")
    if role == "assistant":
        return {"role": role, "content": "".join(x.get("text", "") for x in parts)}
    return {"role": role, "content": parts}


def _part_text(part: object, where: str) -> str:
    """A text content part's text (input_text, output_text or refusal); anything else is refused by name."""
    kind = part.get("type") if isinstance(part, dict) else None
    key = "refusal" if kind == "refusal" else "text"
    if kind not in ("input_text", "output_text", "text", "refusal"):
        raise refuse(where, f"{where}: only text parts are read here, not {kind!r}.")
    value = part.get(key)  # type: ignore[union-attr]
    if not isinstance(value, str):
        raise refuse(f"{where}.{key}", f"{where}.{key} is text.", "invalid_value")
    return value


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise refuse(f"{where}.{key}", f"{where}.{key} is text.")
    return value


def chat_request(
    request: ResponsesRequest, history: list[dict[str, Any]], conversation: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The chat completion request (as JSON) that asks what ``request`` asks, after ``history`` (its previous
    response's stored conversation), as conversation ``conversation`` ("": unnamed, continued by its history);
    and the chat route's fields and message paths as ``request`` names them, for its errors (HttpError.renamed):
    the instructions, the stored chain before the input, each input item."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    inputs, origins = _translated(request.input)
    body: dict[str, Any] = {"model": request.model or "default", "messages": [*system, *history, *inputs]}
    if conversation:
        body["prompt_cache_key"] = conversation
    if request.tools:
        body["tools"] = [_tool(tool, i) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"] = _tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None and request.tools:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if (fmt := (request.text or {}).get("format")) is not None:
        body["response_format"] = _format(fmt)
    for name, value in (
        ("max_tokens", request.max_output_tokens),
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("user", request.user),
        ("safety_identifier", request.safety_identifier),
    ):
        if value is not None:
            body[name] = value
    if request.service_tier not in (None, "auto", "default"):
        raise refuse("service_tier", f"`service_tier` {request.service_tier!r}: one tier is served (auto).")
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    names = dict(CHAT_NAMES)
    for i in range(len(request.tools or ())):  # (a function tool is written flat here)
        names[f"tools[{i}].function"] = f"tools[{i}]"
    if request.instructions:
        names["messages[0]"] = "instructions"
    for h in range(len(history)):
        names[f"messages[{len(system) + h}]"] = Whole("previous_response_id")
    for message, suffix, theirs in origins:
        names[f"messages[{len(system) + len(history) + message}]{suffix}"] = theirs
    return body, names


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise refuse(
            f"tools[{i}]",
            f"tools[{i}]: {tool.get('type')!r} tools are not served here ({BUILT_IN_TOOLS} need OpenAI's servers); "
            "offer function tools.",
        )
    _refuse_keys(tool, TOOL_KEYS, f"tools[{i}]")
    function = {k: tool[k] for k in TOOL_KEYS[1:] if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise refuse("tool_choice", f"`tool_choice` is auto, none, required or a function, not {choice!r}.")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise refuse("tool_choice", '`tool_choice` names a function tool ({"type": "function", "name": ...}).')
    _refuse_keys(choice, ("type", "name"), "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _format(fmt: object) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in FORMAT_KEYS:
        raise refuse(
            "text.format", f"`text.format` is an object of type text, json_object or json_schema, not {fmt!r}."
        )
    _refuse_keys(fmt, FORMAT_KEYS[kind], "text.format")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}


def _refuse_keys(given: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A key not among ``known`` is refused by name: it would otherwise be dropped unread."""
    for key in given:
        if key not in known:
            raise refuse(
                f"{where}.{key}", f"`{where}.{key}` is not read here (it has {', '.join(known)}).", "invalid_value"
            )


# ---------------------------------------------------------------------- answers


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(state: ChoiceState, message_id: str, cut: bool) -> list[dict[str, Any]]:
    """The response's output: the message (when the answer has text), then each function call. In an answer
    ``cut`` by max_output_tokens the last item is the one cut: its status says so (its text or arguments stop where
    the answer stopped), the items before it are whole."""
    out: list[dict[str, Any]] = []
    text = state.content()
    if text:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        out.append({"id": message_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]})
    for call in state.named_calls():
        out.append(
            {
                "id": f"fc_{call.id.removeprefix('call_')}",
                "type": "function_call",
                "status": "completed",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
    if cut and out:
        out[-1]["status"] = "incomplete"
    return out


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


Store = Callable[[dict[str, Any], list[dict[str, Any]]], None]  # (the response, the conversation it ends)


class ResponsesAnswer:
    """Shapes one request's answer as a Response (dispatch.py asks it for the whole one, or its events), and hands
    it to ``store`` with the conversation it ends (``messages``, this answer's message put after them)."""

    def __init__(self, request: ResponsesRequest, model_id: str, messages: list[dict[str, Any]], store: Store | None):
        self.request, self.model_id, self.messages, self.store = request, model_id, messages, store
        self.id = new_id("resp")
        self.message_id = new_id("msg")
        self.created_at = int(time.time())

    def head(self, status: str) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model_id,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": r.instructions,
            "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "text": r.text or {"format": {"type": "text"}},
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "store": r.store is not False,
            "truncation": r.truncation or "disabled",
            "user": r.user,
            "usage": None,
        }

    def finished(self, state: ChoiceState, prompt_tokens: int, cached: int) -> dict[str, Any]:
        """The whole response, stored (unless store is false)."""
        reason = state.finish_reason()  # (raises for an answer that did not end normally)
        incomplete = reason == "length"
        response = self.head("incomplete" if incomplete else "completed")
        response["output"] = output_items(state, self.message_id, cut=incomplete)
        response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        output = state.final.usage.completion_tokens if state.final is not None else 0
        response["usage"] = usage(prompt_tokens, output, cached)
        response["completed_at"] = int(time.time())
        if self.store is not None:
            self.store(response, [*self.messages, state.message()])
        return response

    def whole(self, states: list[ChoiceState], prompt_tokens: int, cached: int) -> dict[str, Any]:
        return self.finished(states[0], prompt_tokens, cached)

    async def events(self, stream: Stream, prompt_tokens: int, cached: int) -> AsyncIterator[bytes]:
        """The Responses event sequence; an error after it started is an ``error`` event, then
        ``response.failed`` (never ``response.completed``)."""
        state = stream.states[0]
        events = Events()
        yield events.emit("response.created", response=self.head("in_progress"))
        yield events.emit("response.in_progress", response=self.head("in_progress"))
        items = OutputItems(events, self.message_id)
        try:
            async for delta in first_choice_deltas(stream):
                for out in items.add(delta):
                    yield out
            response = self.finished(state, stream.generations.prompt_tokens, stream.generations.cached_tokens)
            for out in items.close(response["output"]):
                yield out
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield events.emit(kind, response=response)
        except KvpoolError as exc:  # the status line went out already: the error travels as events
            stream.on_cut(exc)
            error = HttpError.from_kvpool(exc.code, exc.message)
            yield events.emit("error", code=error.code, message=error.message, param=None)
            failed = self.head("failed") | {"error": {"code": error.code, "message": error.message}}
            yield events.emit("response.failed", response=failed)


class Events:
    """Server-sent events with the sequence numbers the Responses stream carries."""

    def __init__(self) -> None:
        self.sequence = 0

    def emit(self, kind: str, **payload: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {msgspec.json.encode(body).decode()}\n\n".encode()


class OutputItems:
    """The output items of a streamed response, from the chat deltas: the message's text, then each call."""

    def __init__(self, events: Events, message_id: str):
        self.events, self.message_id = events, message_id
        self.index = -1
        self.text: list[str] = []
        self.open = ""  # the open item's kind ("": none)
        self.calls: dict[int, dict[str, Any]] = {}  # a chat delta's call index -> its item
        self.call: dict[str, Any] | None = None

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if text := delta.get("content"):
            if self.open != "message":
                out += self._close()
                out += self._open_message()
            self.text.append(text)
            out.append(self._emit("response.output_text.delta", item_id=self.message_id, content_index=0, delta=text))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call's opening: its id and name
                out += self._close()
                self.index += 1
                self.open = "call"
                self.call = {
                    "id": f"fc_{call['id'].removeprefix('call_')}",
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": "",
                }
                out.append(self._emit("response.output_item.added", item=dict(self.call)))
            if (piece := call.get("function", {}).get("arguments")) and self.call is not None:
                self.call["arguments"] += piece
                out.append(self._emit("response.function_call_arguments.delta", item_id=self.call["id"], delta=piece))
        return out

    def close(self, output: list[dict[str, Any]]) -> list[bytes]:
        """The last item's done events, with its status in the whole response's ``output`` (incomplete where the
        answer was cut); the items before it were closed as completed when the next one opened."""
        return self._close(output[-1]["status"] if output else "completed")

    def _open_message(self) -> list[bytes]:
        self.index += 1
        self.open = "message"
        item = {"id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._emit("response.output_item.added", item=item),
            self._emit("response.content_part.added", item_id=self.message_id, content_index=0, part=part),
        ]

    def _close(self, status: str = "completed") -> list[bytes]:
        if self.open == "message":
            text = "".join(self.text)
            part = {"type": "output_text", "text": text, "annotations": []}
            item = {
                "id": self.message_id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
            out = [
                self._emit("response.output_text.done", item_id=self.message_id, content_index=0, text=text),
                self._emit("response.content_part.done", item_id=self.message_id, content_index=0, part=part),
                self._emit("response.output_item.done", item=item),
            ]
        elif self.open == "call" and self.call is not None:
            self.call["status"] = status
            out = [
                self._emit(
                    "response.function_call_arguments.done", item_id=self.call["id"], arguments=self.call["arguments"]
                ),
                self._emit("response.output_item.done", item=dict(self.call)),
            ]
        else:
            out = []
        self.open = ""
        return out

    def _emit(self, kind: str, **payload: Any) -> bytes:
        return self.events.emit(kind, output_index=self.index, **payload)


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def input_item_list(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


def input_items_of(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (what GET .../input_items lists)."""
    raw = (
        [{"type": "message", "role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else request.input
    )
    out = []
    for item in raw:
        item = dict(item)
        item.setdefault("type", "message")
        item.setdefault("id", new_id("msg" if item["type"] == "message" else "item"))
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        out.append(item)
    return out
