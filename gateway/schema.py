"""The OpenAI request bodies, as msgspec Structs that forbid unknown fields: a field this gateway does not know,
a wrong type or a value out of range is a 400 naming the field, before anything reaches the daemon.

Every field of OpenAI's chat-completions and completions requests is declared here (plus llama-server's sampler
extensions), so that each one is either honoured or refused by name (fields.py decides which); none is accepted
and dropped. docs/gateway.md has the table.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=1 << 20)]
Seed = Annotated[int, Meta(ge=0, le=2**32 - 1)]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]
MAX_STOPS = 16  # the daemon's bound (protocol.Generate.stop), a chat template's own stops included
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOPS)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
# OpenAI's logit_bias: token ids (as the JSON object's keys, so strings) to a bias in -100..100.
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=1024)]


class Forbidding(Struct, kw_only=True, forbid_unknown_fields=True):
    """Every request Struct: an unknown field is an error, never ignored."""


class StreamOptions(Forbidding, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None


# ---------------------------------------------------------------------- messages


class ContentPart(Forbidding, kw_only=True):
    """One part of a message's content. Only text parts are honoured; the others are declared so that the
    refusal names them (images, audio and files need a multimodal model)."""

    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    prompt_cache_breakpoint: Any = None


class CalledFunction(Forbidding, kw_only=True):
    name: Name
    arguments: Annotated[str, Meta(max_length=1 << 20)]
    # The openai SDK's parse and stream helpers add their own parse of `arguments` to a message a client sends
    # back: it repeats what `arguments` says, which is what is rendered.
    parsed_arguments: Any = None


class ToolCall(Forbidding, kw_only=True):
    """A call an assistant message made (as a client sends it back): OpenAI's, or a streamed delta's with index."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None


class ChatMessage(Forbidding, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None  # what a response's message carries; a client may send it back
    parsed: Any = None  # the openai SDK helpers' parse of `content` (see CalledFunction.parsed_arguments)


# ---------------------------------------------------------------------- tools and structured output


class FunctionDefinition(Forbidding, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Annotated[str, Meta(max_length=4096)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # strict or not, the arguments are held to the schema (docs/gateway.md)


class FunctionTool(Forbidding, kw_only=True, tag="function", tag_field="type"):
    function: FunctionDefinition


class NamedFunction(Forbidding, kw_only=True):
    name: Name


class NamedToolChoice(Forbidding, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(Forbidding, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None  # strict or not, the answer is held to the schema (docs/gateway.md)


class TextFormat(Forbidding, kw_only=True, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(Forbidding, kw_only=True, tag="json_object", tag_field="type"):
    pass


class JsonSchemaResponseFormat(Forbidding, kw_only=True, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


# ---------------------------------------------------------------------- the two request bodies


class _Request(Forbidding, kw_only=True):
    """What chat and text completions share: OpenAI's common fields and llama-server's sampler extensions."""

    model: Annotated[str, Meta(max_length=256)]
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    max_tokens: MaxTokens | None = None
    n: Annotated[int, Meta(ge=1, le=8)] | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    prompt_cache_key: Name | None = None
    # llama-server's extensions
    top_k: Annotated[int, Meta(ge=0, le=1 << 24)] | None = None
    min_p: MinP | None = None
    typical_p: Probability | None = None
    repeat_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, Meta(ge=0, le=1 << 16)] | None = None


class ChatCompletionRequest(_Request, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)]
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    logprobs: bool | None = None
    max_completion_tokens: MaxTokens | None = None
    metadata: Any = None
    modalities: list[str] | None = None
    moderation: Any = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    reasoning_effort: Any = None
    response_format: ResponseFormat | None = None
    safety_identifier: Annotated[str, Meta(max_length=256)] | None = None
    service_tier: str | None = None
    store: bool | None = None
    tool_choice: ToolChoice | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=128)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_Request, kw_only=True):
    # One text, or OpenAI's other forms (a list of texts, token ids, lists of token ids): fields.py takes one
    # prompt of any form and refuses several (msgspec unions hold one array type, hence the checks there).
    prompt: str | Annotated[list[str | int | list[int]], Meta(min_length=1, max_length=1 << 18)]
    best_of: Annotated[int, Meta(ge=1, le=20)] | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # an extension (as llama-server's): structured output here too
