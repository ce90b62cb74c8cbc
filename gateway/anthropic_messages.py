"""Anthropic's Messages API on the same stateful sessions: ``POST /v1/messages`` and its ``count_tokens``.

A Messages request is translated into a chat completion request (``system``, text, ``image`` (as an image_url
part), ``tool_use`` and ``tool_result`` blocks, ``tools``, ``tool_choice``, ``stop_sequences``, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``metadata.user_id``), so every field is honoured or refused exactly as the
chat route does and a conversation continues from its history with reuse (reported as
``cache_read_input_tokens``). The answer is shaped as Anthropic's: a message with ``text`` and ``tool_use`` blocks
and a ``stop_reason``, or its event stream (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta``, ``message_stop``, ``ping``), and errors in Anthropic's shape. Fields with no chat counterpart
(``thinking``, documents) are refused by name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from starlette.responses import JSONResponse

from kvpool.client.errors import KvpoolError

from .http_errors import RETRY_AFTER_S, HttpError, refuse
from .shaping import ChoiceState
from .streaming import Stream, first_choice_deltas

# The chat route's fields as a Messages request names them, for its errors (HttpError.renamed).
CHAT_NAMES = {
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
}
# Anthropic's error types, by HTTP status (its API uses 529 for overloaded; a gateway's 503 is that).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "api_error",
}


class TextBlock(Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: str
    cache_control: dict[str, Any] | None = None  # every conversation keeps its KV: nothing to mark
    citations: list[Any] | None = None


class ImageBlock(Struct, tag="image", tag_field="type"):
    source: dict[str, Any] = {}


class DocumentBlock(Struct, tag="document", tag_field="type"):
    source: dict[str, Any] = {}


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", forbid_unknown_fields=True):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock


class Message(Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    input_schema: dict[str, Any]
    description: str = ""
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class MessagesRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


def chat_request(request: MessagesRequest | CountTokensRequest) -> tuple[dict[str, Any], dict[str, str]]:
    """The chat completion request (as JSON) that asks for what ``request`` asks, and the chat route's fields and
    message paths as ``request`` names them, for its errors (HttpError.renamed)."""
    if request.thinking is not None and request.thinking != {"type": "disabled"}:
        raise refuse("thinking", "`thinking` is not supported: the served model has no extended thinking.")
    messages, origins = _translated(request)
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise refuse("tool_choice.name", "`tool_choice` of type `tool` needs the `name` of the tool to call.")
        body["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(request, name)) is not None:
                body[name] = value
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
        if request.metadata is not None and request.metadata.user_id:
            body["user"] = request.metadata.user_id
        if request.service_tier is not None and request.service_tier not in ("auto", "standard_only"):
            raise refuse("service_tier", f"`service_tier` {request.service_tier!r}: one tier is served (auto).")
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
    names = dict(CHAT_NAMES)  # (``system``, and each message or tool_result block a chat message came from)
    for i in range(len(request.tools or ())):
        names[f"tools[{i}].function.parameters"] = f"tools[{i}].input_schema"
        names[f"tools[{i}].function"] = f"tools[{i}]"
    for message, suffix, theirs in origins:
        names[f"messages[{message}]{suffix}"] = theirs
    return body, names


def _translated(
    request: MessagesRequest | CountTokensRequest,
) -> tuple[list[dict[str, Any]], list[tuple[int, str, str]]]:
    """The messages as chat messages, and where each came from: (message, a path in it, the request's path)."""
    system = request.system
    out: list[dict[str, Any]] = []
    origins: list[tuple[int, str, str]] = []
    if system:
        out.append(
            {"role": "system", "content": system if isinstance(system, str) else "".join(b.text for b in system)}
        )
        origins.append((0, "", "system"))
    if request.messages and request.messages[-1].role == "assistant":
        last = f"messages[{len(request.messages) - 1}]"
        raise refuse(
            last,
            f"{last} is an assistant message: continuing a prefilled answer is not supported here (it would be "
            "answered as a closed turn). End with a user message, and ask for the opening you want in it.",
        )
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            origins.append((len(out) - 1, "", where))
            continue
        texts: list[Any] = []  # text, and images as OpenAI's image_url parts
        text_blocks: list[str] = []  # the block each came from
        calls: list[dict[str, Any]] = []
        call_blocks: list[str] = []
        results: list[dict[str, Any]] = []
        for k, block in enumerate(message.content):
            at = f"{where}.content[{k}]"
            if isinstance(block, DocumentBlock):
                raise refuse(at, f"{at}: document blocks are not supported here (send their text).")
            if isinstance(block, ImageBlock):
                texts.append(image_part(block, at, message.role))
                text_blocks.append(at)
            elif isinstance(block, TextBlock):
                texts.append(block.text)
                text_blocks.append(at)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise refuse(at, f"{at}: only assistant messages carry `tool_use` blocks.")
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}
                )
                call_blocks.append(at)
            else:
                if message.role != "user":
                    raise refuse(at, f"{at}: only user messages carry `tool_result` blocks.")
                content = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
                if block.is_error:
                    content = f"Error: {content}"
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
                origins += [(len(out) + len(results) - 1, ".tool_call_id", f"{at}.tool_use_id")]
                origins += [(len(out) + len(results) - 1, "", at)]
        if message.role == "assistant":
            assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}  # (text only)
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
            origins.append((len(out) - 1, "", where))
            for n, at in enumerate(call_blocks):
                origins += [(len(out) - 1, f".tool_calls[{n}].id", f"{at}.id"), (len(out) - 1, f".tool_calls[{n}]", at)]
            continue
        out.extend(results)  # (a tool's results come right after the calls, before any text of the turn)
        if any(isinstance(x, dict) for x in texts):
            out.append(
                {"role": "user", "content": [x if isinstance(x, dict) else {"type": "text", "text": x} for x in texts]}
            )
            origins += [(len(out) - 1, f".content[{j}]", at) for j, at in enumerate(text_blocks)]
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
        else:
            continue
        origins.append((len(out) - 1, "", where))
    return out, origins


def image_part(block: ImageBlock, where: str, role: str) -> dict[str, Any]:
    """An image block as OpenAI's image_url part (a data: URL), which the chat route reads (media_parts.py)."""
    if role != "user":
        raise refuse(where, f"{where}: only user messages carry images.")
    source = block.source
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type", "application/octet-stream")  # (none declared: the bytes decide)
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{source['data']}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise refuse(where, f"{where}: an image's source is base64 data (or a url), with its media_type.")


# ---------------------------------------------------------------------- answers


def stop_reason(state: ChoiceState, stop_sequences: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a choice that ended normally."""
    reason = state.finish_reason()  # (raises for an answer that did not end normally)
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = state.final.stop if state.final is not None else None
    if matched is not None and matched in stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class AnthropicAnswer:
    """Shapes one request's answer as Anthropic's (dispatch.py asks it for the whole message, or the events)."""

    def __init__(self, model_id: str, stop_sequences: list[str] | None):
        self.model_id = model_id
        self.stop_sequences = stop_sequences or []
        self.id = new_id("msg")

    def whole(self, states: list[ChoiceState], prompt_tokens: int, cached: int) -> dict[str, Any]:
        state = states[0]
        reason, sequence = stop_reason(state, self.stop_sequences)
        content: list[dict[str, Any]] = []
        text = state.content()
        if text:
            content.append({"type": "text", "text": text})
        for call in state.named_calls():
            try:
                arguments = json.loads(call.arguments)
            except ValueError:  # cut by max_tokens mid-call (stop_reason says so): no whole input to give
                continue
            content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
        output = state.final.usage.completion_tokens if state.final is not None else 0
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(prompt_tokens, output, cached),
        }

    async def events(self, stream: Stream, prompt_tokens: int, cached: int) -> AsyncIterator[bytes]:
        """The message's event stream; an error after it started is an ``error`` event (no ``message_stop``)."""
        state = stream.states[0]
        opening = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prompt_tokens, 0, cached),
        }
        yield event("message_start", {"type": "message_start", "message": opening})
        yield event("ping", {"type": "ping"})
        blocks = Blocks()
        try:
            async for delta in first_choice_deltas(stream):
                for out in blocks.add(delta):
                    yield out
            reason, sequence = stop_reason(state, self.stop_sequences)
            for out in blocks.close():
                yield out
            output = state.final.usage.completion_tokens if state.final is not None else 0
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output}})
            yield event("message_stop", {"type": "message_stop"})
        except KvpoolError as exc:  # the status line went out already: the error travels as an event
            stream.on_cut(exc)
            error = HttpError.from_kvpool(exc.code, exc.message)
            yield event("error", error_body(error))


class Blocks:
    """The content blocks of a streamed message, from the chat deltas: text, then each tool call's block."""

    def __init__(self) -> None:
        self.index = -1
        self.kind = ""  # the open block's type ("": none)
        self.calls: dict[int, int] = {}  # a chat delta's call index -> its block index

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if text := delta.get("content"):
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a call's opening: its id and name
                out += self._open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
                self.calls[call["index"]] = self.index
            if piece := call.get("function", {}).get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def close(self) -> list[bytes]:
        if not self.kind:
            return []
        self.kind = ""
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        return [
            *out,
            event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}),
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


def event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {msgspec.json.encode(payload).decode()}\n\n".encode()


def error_body(error: HttpError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: HttpError) -> JSONResponse:
    """An error in Anthropic's shape, with the gateway's status (and its Retry-After)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)
